"""Attention over a hybrid batch and the paged KV cache in pure torch: the reference any device runs.

The batch's tokens are one flat row set [T]. Each sequence owns a contiguous row range. Its new
K/V are written to their cache slots first, then its queries attend to the cache: positions
0 .. start_pos + i for query i (cached prefix + itself, causally). So a prefill chunk and a
decode are the same computation; they differ only in how they are batched for speed:

* decodes (1 query each) run in groups: sorted by context length and cut into groups of at
  most DECODE_GROUP_TOKENS padded tokens, each group's blocks are gathered into one padded
  [B, L, Hkv, D] tensor and one SDPA call treats the G query heads of each kv head as G
  "positions" (GQA without repeating K/V), with a padding mask per sequence. Sorting keeps
  padding small; the size cap keeps the gathered K/V in CPU cache until SDPA reads it (measured
  on SmolLM2, 32 decodes at 1k context, fp32: groups of 8 sequences cost 0.7x one group of 32);
* chunks of more than one token run one SDPA call each, with a causal mask offset by the
  cached prefix.

This is TorchAttention, the attention backend any device can run (the CPU backend's default
where the native kernel is not faster, and the CUDA backend's fallback without FlashInfer). Its
metadata (AttentionMetadata) describes the batch in device-neutral terms: slots, chunks, and the
decodes as plain lists (DecodeSeqs). The CPU backend (worker_svc/backends/cpu/backend.py)
subclasses it to run all decodes of a batch in one native kernel call that reads K/V in place
from the paged cache (bench/results/kernels/attention_kernel.json), and each chunk on a native
chunk kernel (bench/results/kernels/README.md, "Prefill-chunk attention"); the kernels' own forms
of the batch are built there.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shared.config import cdiv
from worker_svc.kv_cache import PagedKVCache


@dataclass
class ChunkMeta:
    """One multi-token chunk: rows [row_start, row_end) of the batch, positions
    start_pos .. start_pos + n - 1; blocks: its first ceil(context_len / bs) block ids."""

    row_start: int
    row_end: int
    start_pos: int
    blocks: torch.Tensor      # [nb] int64

    @property
    def context_len(self) -> int:
        return self.start_pos + self.row_end - self.row_start


DECODE_GROUP_TOKENS = 8192    # padded context tokens per decode group (see module docstring)


@dataclass
class DecodeMeta:
    """A group of single-token sequences: rows [B] of the batch, block tables padded with block 0 to
    [B, nb], and valid [B, 1, 1, nb * bs] (True for key positions < that sequence's length)."""

    rows: torch.Tensor
    block_tables: torch.Tensor
    valid: torch.Tensor
    contiguous_rows: slice | None   # rows as a slice when they are contiguous (no index copy)
    bias: dict = field(default_factory=dict)   # dtype -> additive mask (0 / -inf), made once


@dataclass
class DecodeSeqs:
    """The single-token sequences (decodes) of a batch, in batch row order: rows[b] its batch
    row, lens[b] its context length including the new token, tables[b] its first
    ceil(lens[b] / block_size) block ids."""

    rows: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)


@dataclass
class AttentionMetadata:
    """What every layer's attention needs for one batch; built once per batch.

    slot_mapping [T] int64: cache slot of each token's K/V. chunks: the multi-token sequences;
    decode_seqs: the single-token ones.
    """

    slot_mapping: torch.Tensor
    chunks: list[ChunkMeta] = field(default_factory=list)
    decode_seqs: DecodeSeqs = field(default_factory=DecodeSeqs)
    block_size: int = 16
    device: torch.device | str = "cpu"
    _decode_groups: list[DecodeMeta] | None = None

    @property
    def decodes(self) -> list[DecodeMeta]:
        """The decodes grouped for the torch path; built on first use, so a batch whose decodes
        a faster kernel serves never pays for them (padded tables, masks)."""
        if self._decode_groups is None:
            d = self.decode_seqs
            self._decode_groups = [_moved(g, self.device) for g in
                                   _decode_groups(d.rows, d.tables, d.lens, self.block_size)] if d.rows else []
        return self._decode_groups

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        """Built on the CPU; moved once per batch to the cache's device (no-op on CPU)."""
        self.device = device
        self.slot_mapping = self.slot_mapping.to(device)
        for c in self.chunks:
            c.blocks = c.blocks.to(device)
        return self


def _moved(d: DecodeMeta, device: torch.device | str) -> DecodeMeta:
    d.rows, d.block_tables, d.valid = (t.to(device) for t in (d.rows, d.block_tables, d.valid))
    return d


def build_metadata(seqs: list[tuple[int, int, list[int]]], block_size: int,
                   meta_type: type[AttentionMetadata] = AttentionMetadata) -> AttentionMetadata:
    """seqs: (start_pos, num_new_tokens, block_table) per sequence, in batch row order.
    The caller has validated that each block table covers start_pos + num_new_tokens.
    meta_type: AttentionMetadata or a backend's subclass of it (whose added fields have defaults).

    Slots are computed with Python ints (a block's slots are one range), and every tensor is made
    once per batch, not per sequence: per-sequence torch ops cost ~1 ms a step at 32 decodes."""
    slots: list[int] = []
    chunks, decodes = [], DecodeSeqs()
    row = 0
    for start, n, table in seqs:
        ctx = start + n
        nb = cdiv(ctx, block_size)
        for b in range(start // block_size, nb):          # the blocks this step writes into
            base = table[b] * block_size - b * block_size
            slots.extend(range(base + max(start, b * block_size), base + min(ctx, (b + 1) * block_size)))
        if n == 1:
            decodes.rows.append(row)
            decodes.tables.append(list(table[:nb]))
            decodes.lens.append(ctx)
        else:
            chunks.append(ChunkMeta(row, row + n, start, torch.tensor(table[:nb], dtype=torch.int64)))
        row += n
    return meta_type(torch.tensor(slots, dtype=torch.int64), chunks, decodes, block_size=block_size)


def pad_tables(tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """[B, max nb] block tables, padded with block 0 (never read past a sequence's length)."""
    nb = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=dtype)


def _decode_groups(rows: list[int], tables: list[list[int]], lens: list[int],
                   bs: int) -> list[DecodeMeta]:
    """Sort by context length; start a new group when padding everyone to the newest (longest)
    member would exceed DECODE_GROUP_TOKENS. Every group has at least one sequence."""
    groups: list[list[int]] = [[]]
    for i in sorted(range(len(rows)), key=lambda i: lens[i]):
        if groups[-1] and (len(groups[-1]) + 1) * len(tables[i]) * bs > DECODE_GROUP_TOKENS:
            groups.append([])
        groups[-1].append(i)
    return [_decode_meta([rows[i] for i in g], [tables[i] for i in g], [lens[i] for i in g], bs)
            for g in groups]


def _decode_meta(rows: list[int], tables: list[list[int]], lens: list[int], bs: int) -> DecodeMeta:
    padded = pad_tables(tables, torch.int64)
    nb = padded.shape[1]
    valid = torch.arange(nb * bs).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return DecodeMeta(torch.tensor(rows), padded, valid[:, None, None, :],
                      slice(rows[0], rows[0] + len(rows)) if contiguous else None)


class TorchAttention:
    """The pure-torch attention backend (any device): decodes in padded groups through SDPA,
    each multi-token chunk one SDPA call with a causal mask offset by its cached prefix."""

    name = "torch"

    def build_metadata(self, seqs: list[tuple[int, int, list[int]]], block_size: int,
                       device: torch.device | str = "cpu") -> AttentionMetadata:
        return build_metadata(seqs, block_size).to(device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache,
                layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of this step's tokens (already rotated) -> out [T, Hq, D]."""
        self._write(cache, layer, meta, k, v)
        out = torch.empty_like(q)
        kc, vc = cache.k[layer], cache.v[layer]
        if meta.decode_seqs.rows:
            self._decodes(q, kc, vc, meta, out, scale)
        for i in range(len(meta.chunks)):
            self._chunk(q, kc, vc, meta, i, out, scale)
        return out

    def _write(self, cache: PagedKVCache, layer: int, meta: AttentionMetadata, k, v) -> None:
        """Store this step's K/V at their slots (a subclass may fuse the cast and copies)."""
        cache.write(layer, meta.slot_mapping, k, v)

    def _decodes(self, q, kc, vc, meta: AttentionMetadata, out, scale) -> None:
        for group in meta.decodes:
            _decode_attention(q, kc, vc, group, out, scale)

    def _chunk(self, q, kc, vc, meta: AttentionMetadata, i: int, out, scale) -> None:
        """The batch's chunk meta.chunks[i] (a subclass may run it on a faster kernel)."""
        _chunk_attention(q, kc, vc, meta.chunks[i], out, scale)


def _decode_attention(q, kc, vc, d: DecodeMeta, out, scale) -> None:
    B, nb = d.block_tables.shape
    _, bs, hkv, dim = kc.shape
    group = q.shape[1] // hkv
    flat = d.block_tables.view(-1)
    # gather into reused buffers: a fresh multi-MB tensor per layer costs page faults
    kbuf, vbuf = _workspace(kc, B * nb)
    keys = torch.index_select(kc, 0, flat, out=kbuf).view(B, nb * bs, hkv, dim).transpose(1, 2)
    vals = torch.index_select(vc, 0, flat, out=vbuf).view(B, nb * bs, hkv, dim).transpose(1, 2)
    qd = q[d.contiguous_rows] if d.contiguous_rows is not None else q.index_select(0, d.rows)
    # GQA: the G query heads sharing a kv head become G query "positions" of that head.
    qd = qd.view(B, hkv, group, dim)
    if keys.dtype != q.dtype:    # a 16-bit cache under an fp32 model: SDPA wants one dtype
        keys, vals = keys.to(q.dtype), vals.to(q.dtype)
    if q.dtype not in d.bias:   # an additive float mask runs faster than a bool one in SDPA on CPU
        d.bias[q.dtype] = torch.zeros(d.valid.shape, dtype=q.dtype,
                                      device=q.device).masked_fill_(~d.valid, float("-inf"))
    o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=d.bias[q.dtype], scale=scale)
    o = o.reshape(B, hkv * group, dim)
    if d.contiguous_rows is not None:
        out[d.contiguous_rows] = o
    else:
        out.index_copy_(0, d.rows, o)


_WORKSPACE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(cache: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two [num_blocks, bs, Hkv, D] buffers shaped like `cache`'s blocks, grown on demand and
    reused by every layer (layers run one after another, so one pair suffices)."""
    key = (cache.dtype, cache.device, tuple(cache.shape[1:]))
    have = _WORKSPACE.get(key)
    if have is None or have[0].shape[0] < num_blocks:
        have = tuple(torch.empty(num_blocks, *cache.shape[1:], dtype=cache.dtype, device=cache.device)
                     for _ in range(2))
        _WORKSPACE[key] = have
    return have[0][:num_blocks], have[1][:num_blocks]


def _chunk_attention(q, kc, vc, c: ChunkMeta, out, scale) -> None:
    _, bs, hkv, dim = kc.shape
    ctx = c.context_len
    group = q.shape[1] // hkv
    keys = kc.index_select(0, c.blocks).view(-1, hkv, dim)[:ctx]
    vals = vc.index_select(0, c.blocks).view(-1, hkv, dim)[:ctx]
    if keys.dtype != q.dtype:    # a 16-bit cache under an fp32 model
        keys, vals = keys.to(q.dtype), vals.to(q.dtype)
    if group > 1:   # chunks are compute-bound: repeating K/V is cheap next to the matmuls
        keys = keys.repeat_interleave(group, dim=1)
        vals = vals.repeat_interleave(group, dim=1)
    qc = q[c.row_start:c.row_end].transpose(0, 1).unsqueeze(0)        # [1, Hq, n, D]
    keys, vals = keys.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0)
    if c.start_pos == 0:
        o = F.scaled_dot_product_attention(qc, keys, vals, is_causal=True, scale=scale)
    else:
        # query i sits at position start_pos + i and sees keys 0 .. start_pos + i
        mask = (torch.arange(ctx, device=q.device).unsqueeze(0)
                <= torch.arange(c.start_pos, ctx, device=q.device).unsqueeze(1))
        o = F.scaled_dot_product_attention(qc, keys, vals, attn_mask=mask, scale=scale)
    out[c.row_start:c.row_end] = o.squeeze(0).transpose(0, 1)
