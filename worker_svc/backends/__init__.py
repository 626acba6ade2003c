"""Device backends (see base.py): select_backend() picks one per worker at start-up."""
from __future__ import annotations

import torch

from worker_svc.backends.base import AttentionBackend, DeviceBackend, LinearMethod, SeqSpec

__all__ = ["AttentionBackend", "DeviceBackend", "LinearMethod", "SeqSpec", "select_backend"]


def select_backend(device: str, compute_dtype: torch.dtype,
                   kv_cache_dtype: torch.dtype | None = None, attention: str = "auto") -> DeviceBackend:
    """The backend for `device` ("cpu", "cuda", "cuda:N"); kv_cache_dtype None = compute dtype.
    attention: "auto" or a device's named choice (CPU: native, torch; CUDA: flashinfer, torch)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        from worker_svc.backends.cpu import cpu_backend
        return cpu_backend(compute_dtype, kv_cache_dtype, attention)
    if dev.type == "cuda":
        from worker_svc.backends.cuda import cuda_backend
        return cuda_backend(dev, compute_dtype, kv_cache_dtype, attention)
    raise ValueError(f"no backend for device {device!r}; choose cpu or cuda[:n]")
