"""BlockManager: fixed-size blocks, a free list, admission with a watermark, growth, release."""
from __future__ import annotations

import pytest

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.request import Request
from shared.sampling import SamplingParams


def req(n_tokens: int, rid: str = "r") -> Request:
    return Request(rid, list(range(1, n_tokens + 1)), SamplingParams(), 0.0)


def test_allocate_gives_enough_blocks_for_every_token_of_the_sequence():
    bm = BlockManager(num_blocks=10, block_size=4)
    r = req(9)
    bm.allocate(r)
    assert len(r.block_table) == 3 and len(set(r.block_table)) == 3
    assert bm.num_free_blocks == 7 and bm.num_used_blocks == 3


def test_can_allocate_keeps_the_watermark_free():
    bm = BlockManager(num_blocks=10, block_size=4, watermark_blocks=2)
    assert bm.can_allocate(req(32))       # 8 blocks, 2 left
    assert not bm.can_allocate(req(33))   # 9 blocks would leave only 1


def test_a_decode_needs_a_new_block_only_when_it_crosses_a_block_boundary():
    bm = BlockManager(num_blocks=10, block_size=4)
    r = req(4)
    bm.allocate(r)
    assert bm.can_append(r)
    bm.append(r)
    assert len(r.block_table) == 1      # 4 tokens fit one block
    r.token_ids.append(99)               # a 5th token was sampled
    bm.append(r)
    assert len(r.block_table) == 2


def test_can_append_is_false_when_no_block_is_free():
    bm = BlockManager(num_blocks=1, block_size=4)
    r = req(4)
    bm.allocate(r)
    r.token_ids.append(99)
    assert not bm.can_append(r)


def test_free_returns_every_block_and_empties_the_table():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = req(8, "a"), req(5, "b")
    bm.allocate(a)
    bm.allocate(b)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 8
    bm.free(b)
    assert bm.num_free_blocks == 10 and bm.ref_counts == [0] * 10


def test_blocks_are_never_handed_out_twice():
    bm = BlockManager(num_blocks=6, block_size=2)
    reqs = [req(4, str(i)) for i in range(3)]
    for r in reqs:
        bm.allocate(r)
    held = [b for r in reqs for b in r.block_table]
    assert sorted(held) == list(range(6))


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=4)
