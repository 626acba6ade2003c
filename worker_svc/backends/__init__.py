"""Device backends (see base.py): select_backend() picks one per worker at start-up."""
from __future__ import annotations

import torch

from worker_svc.backends.base import AttentionBackend, DeviceBackend, LinearMethod, SeqSpec

__all__ = ["AttentionBackend", "DeviceBackend", "LinearMethod", "SeqSpec", "select_backend"]


def select_backend(device: str, compute_dtype: torch.dtype,
                   kv_cache_dtype: torch.dtype | None = None, attention: str = "auto",
                   weight_quant: str = "auto") -> DeviceBackend:
    """The backend for `device` ("cpu", "cuda", "cuda:N"). kv_cache_dtype None = the device's
    default (CPU: 16-bit; CUDA: the compute dtype). weight_quant: "auto" | "none" | "int8" | "int8-bf16" (CPU).
    attention: "auto" or a device's named choice (CPU: native, torch; CUDA: flashinfer, torch)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        from worker_svc.backends.cpu import cpu_backend
        return cpu_backend(compute_dtype, kv_cache_dtype, attention, weight_quant)
    if weight_quant in ("int8", "int8-bf16"):
        raise ValueError(f"weight quantization {weight_quant} is implemented for the CPU only, not {device}")
    if dev.type == "cuda":
        from worker_svc.backends.cuda import cuda_backend
        return cuda_backend(dev, compute_dtype, kv_cache_dtype, attention)
    raise ValueError(f"no backend for device {device!r}; choose cpu or cuda[:n]")
