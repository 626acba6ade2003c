"""The CPU backend: torch matmuls (or weight-only int8 for small batches); decode attention on
the native kernel when it is built and faster than the torch path on this CPU; a 16-bit KV cache.

Chunks (more than one query) always run the torch path (worker_svc.attention): they are
compute-bound and SDPA is good at them. Decodes run the native paged kernel
(worker_svc.native: reads each KV block in place, once) when it is chosen and accepts the
shapes/dtypes; otherwise the torch grouped path.

The three choices, each made once per worker and printed by the executor:
* attention "auto": native when the kernel's SIMD path is in NATIVE_FASTER (recorded by
  bench/attention_kernel.py: AVX-512 and AVX2 beat the torch path; the scalar fallback is slower
  than torch, so it never runs by default);
* KV cache dtype "auto" (None): 16-bit, AUTO_KV_DTYPE. Decode attention is bound by reading the
  cache, so half the bytes is up to 2x. bf16 rather than fp16: widening either costs about the
  same inside the kernel (bf16: zero-extend + shift; fp16: F16C vcvtph2ps; Zen 3 AVX2, 32 x 1k
  context: 15.9 vs 14.9 ms per layer), the torch fallback path casts bf16 faster (25 vs 38 ms;
  bench/results/attention_kernel_amd_contended.json, a contended run), and bf16 keeps fp32's
  exponent range (fp16 overflows at 65504); fp16's 3 extra mantissa bits remain available as
  --kv-cache-dtype float16;
* weight quantization "auto": int8 for small batches (worker_svc/quant.py) when the int8 kernel
  has a SIMD path; "none" keeps the float weights (what HF-exactness tests use).
"""
from __future__ import annotations

import torch

from worker_svc import native
from worker_svc.attention import TorchAttention
from worker_svc.backends.base import DeviceBackend, LinearMethod

# native kernel SIMD paths measured faster than the torch decode path (bench/attention_kernel.py:
# avx512 on Sapphire Rapids 1.7-2x, attention_kernel.json; avx2 on Zen 3 1.6-2.6x,
# attention_kernel_amd_contended.json). The scalar path lost to torch (issue 11: 93 vs 77 ms).
NATIVE_FASTER = ("avx512", "avx2")
AUTO_KV_DTYPE = torch.bfloat16


class NativeCpuAttention(TorchAttention):
    """TorchAttention with the decodes of a batch in one native kernel call per layer."""

    def __init__(self):
        self.name = f"native {native.isa()}"

    def _decodes(self, q, kc, vc, meta, out, scale) -> None:
        nd = meta.native_decode
        # out is empty_like(q): what supports() accepts for q holds for out
        if nd is not None and native.supports(q, kc):
            native.paged_decode_attention(q, kc, vc, nd.tables, nd.lens, scale, out, rows=nd.rows)
        else:
            super()._decodes(q, kc, vc, meta, out, scale)


def cpu_backend(compute_dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None,
                attention: str = "auto", weight_quant: str = "auto") -> DeviceBackend:
    """attention: "auto" (native when built and measured faster here, else torch), "native" or
    "torch". kv_cache_dtype: None = AUTO_KV_DTYPE (the compute dtype when that is 16-bit).
    weight_quant: "auto" (int8 when its kernel has a SIMD path here), "none" or "int8"."""
    if attention not in ("auto", "native", "torch"):
        raise ValueError(f"unknown CPU attention {attention!r}; choose auto, native or torch")
    if attention == "native" and not native.available():
        raise ValueError(f"attention 'native' requested but {native.unavailable_reason()}")
    if weight_quant not in ("auto", "none", "int8"):
        raise ValueError(f"unknown weight quantization {weight_quant!r}; choose auto, none or int8")
    use_native = attention == "native" or (attention == "auto" and native.available()
                                           and native.isa() in NATIVE_FASTER)
    if kv_cache_dtype is None:
        kv_cache_dtype = compute_dtype if compute_dtype.itemsize == 2 else AUTO_KV_DTYPE
    linear = LinearMethod()
    if weight_quant == "int8" or (weight_quant == "auto" and native.available()
                                  and native.int8_isa() != "scalar"):
        from worker_svc.quant import Int8LinearMethod
        linear = Int8LinearMethod()
    return DeviceBackend(torch.device("cpu"), NativeCpuAttention() if use_native else TorchAttention(),
                         linear, kv_cache_dtype)
