"""The CUDA backend: today the torch attention path and cuBLAS matmuls on the device.

FlashInfer paged kernels, CUDA graphs and on-device sampling plug in here (issue 8); until then
a CUDA worker runs the same torch code as the CPU fallback, on the GPU.
"""
from __future__ import annotations

import torch

from worker_svc.attention import TorchAttention
from worker_svc.backends.base import DeviceBackend, LinearMethod


def cuda_backend(device: torch.device, compute_dtype: torch.dtype,
                 kv_cache_dtype: torch.dtype | None = None) -> DeviceBackend:
    if not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but torch sees no CUDA device "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
    return DeviceBackend(device, TorchAttention(), LinearMethod(), kv_cache_dtype or compute_dtype)
