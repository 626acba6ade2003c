"""CUDA graphs for decode-only batches: captured once at start-up, replayed every decode step.

A decode step of an 8B model is ~1,400 kernel launches; launched one by one from Python they
cost more than the GPU work (the profiles in bench/results/gpu/).
A graph replays them with one launch. Graphs have fixed shapes, so a batch of n decodes runs in
the graph of the smallest captured size >= n (capture_sizes), its inputs and attention metadata
padded with dummy sequences that read and write only the scratch block (flashinfer_meta.
pad_decode_batch). Hybrid batches (any sequence with more than one new token) and decode batches
larger than the largest size run eagerly. The runner builds a batch's attention metadata itself
from the sequences' block tables: the model runner only hands it the batch.

The sizing and padding functions are plain code tested on the CPU (tests/worker/test_cuda_graphs.py);
CudaGraphRunner needs a CUDA device and an attention backend with FlashInfer's graph-safe
decode wrappers (backend.py's FlashInferAttention).
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import torch

from worker_svc.backends.base import SeqSpec
from worker_svc.backends.cuda.flashinfer_meta import build_paged_batch, pad_decode_batch

log = logging.getLogger("sarathi.worker")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, ... below max_num_seqs, then max_num_seqs itself
    (padding wastes at most half a batch; a batch never exceeds max_num_seqs decodes)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n sequences; None if n exceeds them all (eager)."""
    return next((s for s in sizes if s >= n), None) if n >= 1 else None


def pad_decode_inputs(token_ids: list[int], positions: list[int], slot_mapping: torch.Tensor,
                      batch_size: int) -> torch.Tensor:
    """[3, batch_size] int64 host tensor: token ids, positions, cache slots. Padding rows get
    token 0 at position 0; their slots are already in slot_mapping (the scratch block's)."""
    n = len(token_ids)
    if len(positions) != n or slot_mapping.shape[0] != batch_size or n > batch_size:
        raise ValueError(f"{n} tokens, {len(positions)} positions, {slot_mapping.shape[0]} slots "
                         f"do not make a padded batch of {batch_size}")
    out = torch.zeros(3, batch_size, dtype=torch.int64)
    out[0, :n] = torch.tensor(token_ids, dtype=torch.int64)
    out[1, :n] = torch.tensor(positions, dtype=torch.int64)
    out[2] = slot_mapping
    return out


class CudaGraphRunner:
    """One captured graph per size in `sizes` for `model` over `cache`.

    The graphs read their inputs from static device buffers (self.inputs rows: ids, positions,
    slots) and write logits [size, V] float32 to static outputs; run() builds a batch's paged
    metadata, copies its padded inputs in, re-plans that size's FlashInfer decode wrapper (its
    plan() writes into the wrapper's fixed buffers, which the captured kernels read), replays,
    and returns a view of the real rows. The view is overwritten by the next replay: use it
    before the next run(). scratch_block: the block padding rows read and write (never a
    request's).
    """

    def __init__(self, model: torch.nn.Module, cache, attention, sizes: list[int],
                 scratch_block: int, device: torch.device):
        self.model, self.cache, self.attention = model, cache, attention
        self.sizes, self.scratch_block = sorted(sizes), scratch_block
        self.page_size = cache.block_size
        biggest = self.sizes[-1]
        self.inputs = torch.zeros(3, biggest, dtype=torch.int64, device=device)
        self.rows = torch.arange(biggest, device=device)
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays: dict[int, Callable[[], None]] = {}
        self.wrappers: dict[int, object] = {}
        self._graphs: list = []
        self._pool = None
        self._cuda = torch.device(device).type == "cuda"   # False: the CPU harness (tests)
        t0 = time.perf_counter()
        for b in reversed(self.sizes):          # largest first: the smaller ones reuse its pool
            wrapper = attention.decode_wrapper(b)
            meta = attention.metadata(wrapper, self.inputs[2, :b])
            attention.plan(wrapper, pad_decode_batch(build_paged_batch([], self.page_size), b, scratch_block))
            step = functools.partial(model, self.inputs[0, :b], self.inputs[1, :b], cache, meta, self.rows[:b])
            step()                               # warm-up: lazy inits happen outside the graph
            self.outputs[b], self.replays[b] = self._capture(step, device)
            self.wrappers[b] = wrapper
        log.info("captured CUDA graphs for decode batch sizes %s in %.1f s", self.sizes,
                 time.perf_counter() - t0)

    def _capture(self, step: Callable[[], torch.Tensor], device: torch.device):
        """(static output, replay) of one graph of `step`; all graphs share one memory pool."""
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = step()
        torch.cuda.synchronize(device)
        self._pool = graph.pool()
        self._graphs.append(graph)
        return out, graph.replay

    def run(self, seqs: list[SeqSpec], token_ids: list[int], positions: list[int],
            patch: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """Logits [len(seqs), V] (float32, on the device) of a decode-only batch, or None when no
        graph fits (hybrid, or more sequences than the largest size): run it eagerly. seqs: the
        batch's (start_pos, num_new_tokens >= 1, block_table); token_ids, positions: its rows;
        patch(ids): edits the device row of token ids before the replay (GraphRunner.run).

        Nothing here waits for the work already queued on the device, so batch n + 1 can be
        prepared while batch n runs: the inputs go to the device from pinned memory without
        blocking, and so does the plan (FlashInferAttention.plan)."""
        # every sequence has at least one new token: one row per sequence means decode-only
        b = bucket_for(len(seqs), self.sizes) if len(token_ids) == len(seqs) else None
        if b is None:
            return None
        pb = build_paged_batch(seqs, self.page_size)
        padded = pad_decode_batch(pb, b, self.scratch_block)
        inputs = pad_decode_inputs(token_ids, positions, padded.slot_mapping, b)
        if self._cuda:
            inputs = inputs.pin_memory()
        self.inputs[:, :b].copy_(inputs, non_blocking=self._cuda)
        if patch is not None:
            patch(self.inputs[0, :b])
        self.attention.plan(self.wrappers[b], padded)
        self.replays[b]()
        return self.outputs[b][:pb.num_seqs]
