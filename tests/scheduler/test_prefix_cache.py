"""Prefix caching: full blocks keyed by a chained hash, ref-counted, reused across requests."""
from __future__ import annotations

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.prefix_cache import ROOT_HASH, chain_hash, extend_block_hashes
from scheduler_svc.request import Request
from scheduler_svc.sim_executor import sim_engine
from shared.sampling import SamplingParams

PREFIX = list(range(100, 164))   # a 64-token shared "system prompt"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def run_two_sharing_a_prefix(enable_prefix_caching: bool):
    """Request 1 runs its prefill, then request 2 (same 64-token prefix) arrives."""
    loop = sim_engine("sarathi", block_size=16, num_blocks=64, token_budget=256,
                      enable_prefix_caching=enable_prefix_caching)
    first = loop.add_request("first", PREFIX + [1, 2, 3], GREEDY)
    loop.step()
    second = loop.add_request("second", PREFIX + [4, 5, 6, 7], GREEDY)
    loop.run_until_done()
    return loop, first, second


def test_a_shared_64_token_prefix_is_computed_once():
    loop, _, _ = run_two_sharing_a_prefix(enable_prefix_caching=True)
    base, _, _ = run_two_sharing_a_prefix(enable_prefix_caching=False)
    assert loop.scheduler.stats()["prefix_cache_hit_tokens"] == 64
    assert base.executor.computed_tokens - loop.executor.computed_tokens == 64


def test_prefix_caching_does_not_change_the_outputs():
    _, a1, b1 = run_two_sharing_a_prefix(enable_prefix_caching=True)
    _, a2, b2 = run_two_sharing_a_prefix(enable_prefix_caching=False)
    assert a1.output_token_ids == a2.output_token_ids
    assert b1.output_token_ids == b2.output_token_ids


def test_a_block_key_names_the_whole_prefix_not_just_the_block():
    assert chain_hash(ROOT_HASH, [1, 2]) != chain_hash(chain_hash(ROOT_HASH, [9, 9]), [1, 2])


def test_block_hashes_cover_only_full_blocks():
    assert len(extend_block_hashes([], list(range(10)), 4, 10 // 4)) == 2


def _req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(), 0.0)


def _computed(bm, r):
    """Pretend r's batch ran: all its tokens are computed and its full blocks keyed."""
    r.num_computed_tokens = r.num_tokens
    bm.cache_computed_blocks(r)


def test_a_shared_block_is_reference_counted():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a, b = _req("a", range(1, 10)), _req("b", range(1, 10))
    bm.allocate(a)
    _computed(bm, a)
    assert bm.allocate(b) == 8               # two full blocks found cached
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_table[:2]] == [1, 1]


def test_freed_blocks_stay_findable_until_reused():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = _req("a", range(1, 10))
    bm.allocate(a)
    _computed(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 8
    assert bm.allocate(_req("b", range(1, 10))) == 8


def test_uncached_blocks_are_reused_before_cached_ones_and_cached_ones_oldest_first():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = _req("a", [1, 2, 3, 4, 5])      # 2 full blocks + 1 partial (uncached)
    bm.allocate(a)
    _computed(bm, a)
    cached = a.block_table[:2]
    bm.free(a)
    order = [bm._take_free() for _ in range(4)]
    assert order[-2:] == cached[::-1]    # cached blocks last, the prefix's tail before its head
    assert set(order[:2]).isdisjoint(cached)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = _req("a", range(1, 9))           # exactly two full blocks
    bm.allocate(a)
    _computed(bm, a)
    b = _req("b", range(1, 9))
    assert bm.allocate(b) == 4           # only the first block: the last token must be computed
    assert b.num_new_tokens == 4


def test_blocks_are_keyed_only_after_their_batch_has_run():
    """Two identical prompts scheduled in the same batch cannot share: nothing is computed yet."""
    loop = sim_engine("sarathi", block_size=4, num_blocks=32, token_budget=64,
                      enable_prefix_caching=True)
    loop.add_request("a", list(range(1, 13)), GREEDY)
    loop.add_request("b", list(range(1, 13)), GREEDY)
    loop.run_until_done()                 # the SimExecutor raises on a read of an unwritten slot
    assert loop.scheduler.stats()["prefix_cache_hit_tokens"] == 0


def test_a_preempted_request_finds_its_own_blocks_again():
    loop = sim_engine("sarathi", block_size=4, num_blocks=8, token_budget=64,
                      enable_prefix_caching=True)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    loop.add_request("old", list(range(1, 9)), sp)
    loop.add_request("new", list(range(20, 28)), sp)
    loop.run_until_done()
    stats = loop.scheduler.stats()
    assert stats["num_preemptions"] >= 1 and stats["prefix_cache_hit_tokens"] > 0


def test_a_request_arriving_mid_prefill_of_its_twin_shares_only_the_computed_blocks():
    loop = sim_engine("sarathi", block_size=4, num_blocks=32, token_budget=8,
                      enable_prefix_caching=True)
    prompt = list(range(1, 13))
    loop.add_request("x", prompt, GREEDY)
    loop.step()                           # x: 8 of 12 prompt tokens computed
    y = loop.add_request("y", prompt + [99], GREEDY)
    loop.step()                           # x's last chunk and y's first in one batch
    assert loop.scheduler.stats()["prefix_cache_hit_tokens"] == 8
    loop.run_until_done()                 # the SimExecutor checks every KV read
    assert y.output_token_ids


def test_after_the_worker_lost_its_kv_no_prefix_is_found_again():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a, held = _req("a", range(1, 10)), _req("held", range(20, 29))
    bm.allocate(a), bm.allocate(held)
    _computed(bm, a), _computed(bm, held)
    bm.free(a)                                    # a's blocks stay findable while free...
    assert bm.allocate(_req("probe", range(1, 10))) == 8
    bm2 = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a2, held2 = _req("a", range(1, 10)), _req("held", range(20, 29))
    bm2.allocate(a2), bm2.allocate(held2)
    _computed(bm2, a2), _computed(bm2, held2)
    bm2.free(a2)
    bm2.forget_cached_contents()                  # ...until the worker restarts
    bm2.free(held2)                               # freed after the restart: not findable either
    assert bm2.allocate(_req("b", range(1, 10))) == 0
    assert bm2.allocate(_req("c", range(20, 29))) == 0
    assert bm2.num_free_blocks + bm2.num_used_blocks == 8
