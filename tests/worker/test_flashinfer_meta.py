"""FlashInfer's per-batch metadata, built on the host from the block tables, describes exactly
what the torch attention path reads: the same cache slots for every key of every sequence, the
same rows, and (through a plain-torch FlashInfer reference) the same attention output, for
hybrid batches of decodes and chunks with cached prefixes on shuffled blocks. CPU only."""
from __future__ import annotations

import pytest
import torch

from tests.support.engine_helpers import BlockPool, blocks_for
from tests.support.flashinfer_reference import reference_attention
from worker_svc.backends.cuda.flashinfer_meta import build_paged_batch, key_slots, pad_decode_batch
from worker_svc.backends.torch_attention import TorchAttention, build_metadata
from worker_svc.kv_cache import PagedKVCache

BS = 16
NUM_BLOCKS = 160


def hybrid_specs(seed: int) -> list[tuple[int, int, list[int]]]:
    """Decodes at assorted contexts (block-boundary cases included), chunks with and without a
    cached prefix, interleaved, on shuffled block ids."""
    pool = BlockPool(NUM_BLOCKS, shuffle_seed=seed)
    g = torch.Generator().manual_seed(seed)
    shapes = [(15, 1), (16, 1), (0, 37), (100, 1), (32, 16), (47, 20), (1, 1), (0, 1), (64, 1),
              (int(torch.randint(1, 200, (1,), generator=g)), 1),
              (int(torch.randint(0, 150, (1,), generator=g)), int(torch.randint(2, 60, (1,), generator=g)))]
    order = torch.randperm(len(shapes), generator=g).tolist()
    return [(s, n, pool.take(blocks_for(s + n, BS) + 1)) for s, n in (shapes[i] for i in order)]


def table_slots(start: int, n: int, table: list[int]) -> torch.Tensor:
    pos = torch.arange(start + n)
    return torch.tensor(table, dtype=torch.int64)[pos // BS] * BS + pos % BS


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metadata_names_the_slots_the_torch_path_reads(seed):
    specs = hybrid_specs(seed)
    pb = build_paged_batch(specs, BS)
    torch_meta = build_metadata(specs, BS)
    assert torch.equal(pb.slot_mapping, torch_meta.slot_mapping)
    assert not pb.decode_only and pb.num_seqs == len(specs)
    assert pb.qo_indptr.tolist() == [0] + torch.tensor([n for _, n, _ in specs]).cumsum(0).tolist()
    chunks = iter(torch_meta.chunks)
    decode_i = 0
    nd = torch_meta.decode_seqs
    for i, (start, n, table) in enumerate(specs):
        got = key_slots(pb, i)
        assert torch.equal(got, table_slots(start, n, table))          # every key position, in order
        row0 = int(pb.qo_indptr[i])
        if n == 1:                      # what the torch path's decode tables + lengths cover
            assert int(nd.rows[decode_i]) == row0 and int(nd.lens[decode_i]) == start + 1
            read = torch.tensor(nd.tables[decode_i])
            decode_i += 1
        else:                           # what the torch path's chunk gathers
            c = next(chunks)
            assert (c.row_start, c.row_end, c.start_pos) == (row0, row0 + n, start)
            read = c.blocks
        pos = torch.arange(start + n)
        assert torch.equal(got, read[pos // BS] * BS + pos % BS)
    # the last page holds 1..BS tokens
    assert ((pb.kv_last_page_len >= 1) & (pb.kv_last_page_len <= BS)).all()


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4)])
def test_flashinfer_semantics_on_this_metadata_equal_the_torch_path(seed, hq, hkv):
    """The reference of what FlashInfer computes from (indptr, indices, last_page_len), causal
    bottom-right, after the batch's K/V were written to slot_mapping == TorchAttention.forward."""
    specs = hybrid_specs(seed)
    g = torch.Generator().manual_seed(seed)
    dim, T = 8, sum(n for _, n, _ in specs)
    cache = PagedKVCache(1, NUM_BLOCKS, BS, hkv, dim, torch.float32)
    cache.k[0].normal_(generator=g)
    cache.v[0].normal_(generator=g)
    q, k, v = (torch.randn(T, h, dim, generator=g) for h in (hq, hkv, hkv))
    scale = dim ** -0.5
    expected = TorchAttention().forward(q, k, v, cache, 0, TorchAttention().build_metadata(specs, BS), scale)
    pb = build_paged_batch(specs, BS)       # the cache already holds this batch's K/V at pb's slots
    assert torch.allclose(reference_attention(q, cache.k[0], cache.v[0], pb, scale), expected, atol=1e-5)


def test_decode_only_batch_and_padding_to_a_graph_size():
    pool = BlockPool(NUM_BLOCKS, shuffle_seed=5)
    specs = [(c, 1, pool.take(blocks_for(c + 1, BS))) for c in (0, 15, 16, 70)]
    pb = build_paged_batch(specs, BS)
    assert pb.decode_only
    scratch = NUM_BLOCKS                    # the block the scheduler never hands out
    padded = pad_decode_batch(pb, 8, scratch)
    assert padded.num_seqs == 8 and padded.num_tokens == 8 and padded.decode_only
    for i in range(4):                      # real sequences untouched
        assert torch.equal(key_slots(padded, i), key_slots(pb, i))
    assert torch.equal(padded.slot_mapping[:4], pb.slot_mapping)
    for i in range(4, 8):                   # padding: one key in the scratch block, written there
        assert key_slots(padded, i).tolist() == [scratch * BS]
    assert padded.slot_mapping[4:].tolist() == [scratch * BS] * 4
    assert padded.qo_indptr.tolist() == list(range(9))
    assert pad_decode_batch(pb, 4, scratch) is pb
    # padded rows leave the real rows' attention unchanged
    g = torch.Generator().manual_seed(0)
    cache_k = torch.randn(NUM_BLOCKS + 1, BS, 2, 8, generator=g)
    cache_v = torch.randn(NUM_BLOCKS + 1, BS, 2, 8, generator=g)
    q = torch.randn(8, 4, 8, generator=g)
    assert torch.allclose(reference_attention(q, cache_k, cache_v, padded, 0.3)[:4],
                          reference_attention(q[:4], cache_k, cache_v, pb, 0.3))


def test_padding_refuses_hybrid_or_oversized_batches():
    hybrid = build_paged_batch([(0, 5, [0]), (3, 1, [1])], BS)
    with pytest.raises(ValueError, match="decode-only"):
        pad_decode_batch(hybrid, 4, 9)
    decodes = build_paged_batch([(3, 1, [1]), (4, 1, [2])], BS)
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode_batch(decodes, 1, 9)


def test_empty_batch_pads_to_all_scratch():
    padded = pad_decode_batch(build_paged_batch([], BS), 2, 7)
    assert padded.kv_indices.tolist() == [7, 7] and padded.kv_last_page_len.tolist() == [1, 1]
