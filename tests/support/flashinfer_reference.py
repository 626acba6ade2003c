"""FlashInfer's paged attention written out in plain torch: the definition the metadata
(worker_svc.backends.cuda.flashinfer_meta) is tested against on the CPU, and the kernels on a GPU."""
from __future__ import annotations

import torch

from worker_svc.backends.cuda.flashinfer_meta import PagedBatch, key_slots


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        pb: PagedBatch, scale: float) -> torch.Tensor:
    """What FlashInfer's paged prefill (causal, bottom-right aligned) computes, in plain torch,
    one sequence at a time: q [T, Hq, D], caches [num_blocks, page_size, Hkv, D] -> [T, Hq, D].

    Slow; the definition the metadata is tested against on the CPU (and the GPU kernels on a GPU)."""
    hkv, dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // hkv
    flat_k, flat_v = k_cache.reshape(-1, hkv, dim), v_cache.reshape(-1, hkv, dim)
    out = torch.empty_like(q)
    for i in range(pb.num_seqs):
        r0, r1 = int(pb.qo_indptr[i]), int(pb.qo_indptr[i + 1])
        slots = key_slots(pb, i)
        kv_len, nq = slots.shape[0], r1 - r0
        keys = flat_k[slots].float().repeat_interleave(group, dim=1)       # [kv, Hq, D]
        vals = flat_v[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[r0:r1].float(), keys) * scale
        allowed = torch.arange(kv_len)[None, :] <= (kv_len - nq + torch.arange(nq))[:, None]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[r0:r1] = torch.einsum("hqk,khd->qhd", probs, vals).to(q.dtype)
    return out
