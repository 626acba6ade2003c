"""FlashInfer's paged-attention metadata for one hybrid batch, built once per batch on the host.

Plain torch on the CPU, no flashinfer import: the CUDA backend (backend.py beside this file)
hands these tensors to a wrapper's plan() once per batch, and every layer's run() reuses the
plan. Tested on the CPU against what the torch attention path reads (tests/worker/test_flashinfer_meta.py).

FlashInfer's paged KV format: sequence i owns the pages kv_indices[kv_indptr[i]:kv_indptr[i+1]]
in position order; every page is full but the last, which holds kv_last_page_len[i] tokens
(1 .. page_size). Its queries are the batch rows qo_indptr[i]:qo_indptr[i+1]. With causal=True,
query j of a sequence with q queries and kv keys sits at position kv - q + j (bottom-right
aligned) and sees keys 0 .. kv - q + j: the engine's rule (a chunk attends to its cached prefix
plus itself, causally; a decode to its whole context).

Pages are the scheduler's block ids and the page size is the block size: the worker's cache
(k and v per layer, each [num_blocks, block_size, Hkv, D]) passed as the tuple (k, v) is
FlashInfer's NHD paged layout as it is, so the CPU and CUDA backends share PagedKVCache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.config import cdiv


@dataclass
class PagedBatch:
    """Host (CPU) tensors describing one batch for FlashInfer; S sequences, T tokens.

    qo_indptr [S+1] int32: batch rows of each sequence's queries.
    kv_indptr [S+1] int32, kv_indices [kv_indptr[-1]] int32, kv_last_page_len [S] int32: pages.
    slot_mapping [T] int64: cache slot (block * page_size + offset) of each token's new K/V.
    decode_only: every sequence has exactly one query (the decode kernels and CUDA graphs apply).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    slot_mapping: torch.Tensor
    page_size: int
    decode_only: bool

    @property
    def num_seqs(self) -> int:
        return self.kv_last_page_len.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def build_paged_batch(seqs: list[tuple[int, int, list[int]]], page_size: int) -> PagedBatch:
    """seqs: (start_pos, num_new_tokens, block_table) per sequence, in batch row order; the
    caller has checked that each table covers start_pos + num_new_tokens (the model runner does).

    Sequence i has kv_len = start_pos + n keys (its cached prefix and its n new tokens, whose
    K/V the attention backend writes to slot_mapping before any query reads the cache)."""
    qo, kv, last, indices = [0], [0], [], []
    slots: list[np.ndarray] = []
    pending: list[int] = []      # slots of consecutive decodes, flushed as one array
    decode_only = True
    for start, n, table in seqs:
        ctx = start + n
        nb = cdiv(ctx, page_size)
        indices.extend(table[:nb])
        qo.append(qo[-1] + n)
        kv.append(kv[-1] + nb)
        last.append(ctx - (nb - 1) * page_size)
        if n == 1:
            pending.append(table[start // page_size] * page_size + start % page_size)
            continue
        decode_only = False
        if pending:
            slots.append(np.array(pending, dtype=np.int64))
            pending = []
        pos = np.arange(start, ctx)
        bt = np.array(table[:nb], dtype=np.int64)
        slots.append(bt[pos // page_size] * page_size + pos % page_size)
    if pending:
        slots.append(np.array(pending, dtype=np.int64))
    # numpy turns the Python lists into arrays several times faster than torch.tensor does
    # (the page list is every sequence's block table: thousands of ids a step); from_numpy
    # wraps the array without a copy
    def i32(x: list[int]) -> torch.Tensor:
        return torch.from_numpy(np.array(x, dtype=np.int32))
    return PagedBatch(i32(qo), i32(kv), i32(indices), i32(last),
                      torch.from_numpy(np.concatenate(slots)) if slots else torch.empty(0, dtype=torch.int64),
                      page_size, decode_only)


def pad_decode_batch(pb: PagedBatch, batch_size: int, scratch_block: int) -> PagedBatch:
    """A decode-only batch padded to batch_size sequences (a CUDA graph's fixed size).

    Each padding sequence has one query and one key in one page, `scratch_block`: a block the
    scheduler never hands out, so the padding rows' K/V writes (all to its slot 0) and reads
    touch no request's KV. The real sequences keep their rows, pages and slots unchanged."""
    if not pb.decode_only:
        raise ValueError("only decode-only batches are padded (hybrid batches run eagerly)")
    pad = batch_size - pb.num_seqs
    if pad < 0:
        raise ValueError(f"batch of {pb.num_seqs} sequences does not fit size {batch_size}")
    if pad == 0:
        return pb
    i32 = dict(dtype=torch.int32)
    ramp = torch.arange(1, pad + 1, **i32)
    return PagedBatch(
        torch.cat([pb.qo_indptr, pb.qo_indptr[-1] + ramp]),
        torch.cat([pb.kv_indptr, pb.kv_indptr[-1] + ramp]),
        torch.cat([pb.kv_indices, torch.full((pad,), scratch_block, **i32)]),
        torch.cat([pb.kv_last_page_len, torch.ones(pad, **i32)]),
        torch.cat([pb.slot_mapping, torch.full((pad,), scratch_block * pb.page_size, dtype=torch.int64)]),
        pb.page_size, True)


def key_slots(pb: PagedBatch, i: int) -> torch.Tensor:
    """The cache slots [kv_len] int64 of sequence i's keys at positions 0 .. kv_len - 1, as
    FlashInfer reads them from the page list (what the tests compare with the torch path)."""
    lo, hi = int(pb.kv_indptr[i]), int(pb.kv_indptr[i + 1])
    pages = pb.kv_indices[lo:hi].to(torch.int64)
    kv_len = (hi - lo - 1) * pb.page_size + int(pb.kv_last_page_len[i])
    pos = torch.arange(kv_len)
    return pages[pos // pb.page_size] * pb.page_size + pos % pb.page_size

