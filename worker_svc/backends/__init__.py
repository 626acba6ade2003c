"""Device backends (see base.py): select_backend() picks one per worker at start-up.

Layout: base.py is the contract (DeviceBackend, AttentionBackend, LinearMethod, Ops and the
graph-runner protocol; a backend's sampler is a worker_svc.sampling.TokenSampler);
torch_attention.py the pure-torch attention any device can run; cpu/ the CPU backend (native
kernels in cpu/csrc, int8 linear layers); cuda/ the CUDA backend (FlashInfer, CUDA graphs, KV
sizing from device memory; it samples with worker_svc.sampling.DeviceFirstSampler). Code outside
this package uses only what this module exports. The backends use the sampling package and the
model's data types (worker_svc.model_config, worker_svc.gguf_blocks), never the model itself.
"""
from __future__ import annotations

import torch

from worker_svc.backends.base import (
    AttentionBackend,
    DeviceBackend,
    GraphRunner,
    LinearMethod,
    Ops,
    Readback,
    SeqSpec,
)

__all__ = ["AttentionBackend", "DeviceBackend", "GraphRunner", "LinearMethod", "Ops", "Readback", "SeqSpec",
           "parse_dtype", "parse_kv_cache_dtype", "select_backend"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KV_CACHE_DTYPES = {**DTYPES, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype | None:
    """A compute dtype name -> the dtype; "auto" -> None (the backend's default_dtype)."""
    if name == "auto":
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_kv_cache_dtype(name: str) -> torch.dtype | None:
    """A KV cache dtype name -> the dtype; "auto" -> None (the backend's default for its device)."""
    if name == "auto":
        return None
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def select_backend(device: str, compute_dtype: torch.dtype | None = None,
                   kv_cache_dtype: torch.dtype | None = None, attention: str = "auto",
                   weight_quant: str = "auto") -> DeviceBackend:
    """The backend for `device` ("cpu", "cuda", "cuda:N"). compute_dtype None = the device's
    default_dtype (CPU: float32, CUDA: bfloat16). kv_cache_dtype None = the device's default
    (CPU: 16-bit; CUDA: the compute dtype). weight_quant: "auto" | "none" | "int8" | "int8-bf16"
    (CPU). attention: "auto" or a device's named choice (CPU: native, torch; CUDA: flashinfer, torch)."""
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
