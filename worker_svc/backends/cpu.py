"""The CPU backend: torch matmuls; decode attention on the native kernel when it is built.

Chunks (more than one query) always run the torch path (worker_svc.attention): they are
compute-bound and SDPA is good at them. Decodes run the native paged kernel
(worker_svc.native: reads each KV block in place, once) when it is available and accepts the
shapes/dtypes; otherwise the torch grouped path.
"""
from __future__ import annotations

import torch

from worker_svc import native
from worker_svc.attention import TorchAttention
from worker_svc.backends.base import DeviceBackend, LinearMethod


class NativeCpuAttention(TorchAttention):
    """TorchAttention with the decodes of a batch in one native kernel call per layer."""

    name = "native"

    def _decodes(self, q, kc, vc, meta, out, scale) -> None:
        nd = meta.native_decode
        # out is empty_like(q): what supports() accepts for q holds for out
        if nd is not None and native.supports(q, kc):
            native.paged_decode_attention(q, kc, vc, nd.tables, nd.lens, scale, out, rows=nd.rows)
        else:
            super()._decodes(q, kc, vc, meta, out, scale)


def cpu_backend(compute_dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None,
                attention: str = "auto") -> DeviceBackend:
    """attention: "auto" (native when it builds and loads, else torch), "native" or "torch"."""
    if attention not in ("auto", "native", "torch"):
        raise ValueError(f"unknown CPU attention {attention!r}; choose auto, native or torch")
    if attention == "native" and not native.available():
        raise ValueError(f"attention 'native' requested but {native.unavailable_reason()}")
    use_native = attention != "torch" and native.available()
    return DeviceBackend(torch.device("cpu"),
                         NativeCpuAttention() if use_native else TorchAttention(),
                         LinearMethod(), kv_cache_dtype or compute_dtype)
