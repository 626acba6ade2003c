"""How many KV blocks fit on the device: sized after a profiling forward pass at the largest batch.

On a GPU the KV cache takes what the weights and the activations of the largest batch leave of
`gpu_memory_utilization` x the device's memory (vLLM's rule). The profiling pass runs
max_num_batched_tokens prompt tokens (in sequences of at most max_model_len) through the model,
with a cache just big enough for them, and records torch's peak allocation; memory other
processes or the CUDA context hold is counted as used too. CUDA graphs are captured after the
cache is allocated: their pool (decode activations, small) comes out of the remaining headroom.

blocks_that_fit is plain arithmetic (tested on the CPU); profile_peak_bytes needs CUDA.
"""
from __future__ import annotations

import torch

from shared.config import cdiv
from worker_svc.kv_cache import PagedKVCache


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> int:
    """Bytes of one KV block over all layers (k and v)."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def blocks_that_fit(total_bytes: int, peak_bytes: int, other_bytes: int, utilization: float,
                    bytes_per_block: int) -> int:
    """Blocks in utilization x total_bytes after the profiled peak of torch allocations and the
    memory torch does not manage (CUDA context, other processes). Raises if none fit."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(total_bytes * utilization) - peak_bytes - other_bytes
    blocks = budget // bytes_per_block
    if blocks < 1:
        gib = 1 << 30
        raise ValueError(
            f"no room for the KV cache: {utilization:.2f} x {total_bytes / gib:.1f} GiB leaves "
            f"{budget / gib:.2f} GiB after the model and activations ({peak_bytes / gib:.1f} GiB) and "
            f"other use ({other_bytes / gib:.1f} GiB); raise --gpu-memory-utilization, lower "
            f"--max-num-batched-tokens, or use a smaller model")
    return blocks


def profile_sequences(num_tokens: int, max_model_len: int, block_size: int) -> list[tuple[int, int, list[int]]]:
    """(start_pos, n, block_table) of prefill sequences totalling num_tokens, each at most
    max_model_len, on consecutive blocks from 0."""
    seqs, next_block = [], 0
    while num_tokens > 0:
        n = min(num_tokens, max_model_len)
        nb = cdiv(n, block_size)
        seqs.append((0, n, list(range(next_block, next_block + nb))))
        next_block += nb
        num_tokens -= n
    return seqs


@torch.inference_mode()
def profile_peak_bytes(model, backend, num_layers: int, num_kv_heads: int, head_dim: int,
                       block_size: int, num_tokens: int, max_model_len: int,
                       device: torch.device) -> tuple[int, int]:
    """(peak torch allocation, memory used outside torch) in bytes around one forward pass of
    num_tokens prompt tokens; the temporary cache is freed before returning."""
    seqs = profile_sequences(num_tokens, max_model_len, block_size)
    num_blocks = sum(len(t) for _, _, t in seqs) + backend.scratch_blocks
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    cache = PagedKVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                         backend.kv_cache_dtype, device)
    meta = backend.attention.build_metadata(seqs, block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n) for _, n, _ in seqs]).to(device)
    rows, row = [], 0
    for _, n, _ in seqs:
        row += n
        rows.append(row - 1)
    model(ids, positions, cache, meta, torch.tensor(rows, device=device))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - sum(
        t.numel() * t.element_size() for t in cache.k + cache.v)     # the temporary cache is not model memory
    free, total = torch.cuda.mem_get_info(device)
    other = total - free - torch.cuda.memory_reserved(device)
    del cache, meta
    torch.cuda.empty_cache()
    return peak, max(other, 0)
