"""Weight-only int8 linear layers for decode-heavy batches (CPU), behind the LinearMethod seam.

Quantization: symmetric, one fp32 scale per output row: scale[n] = max_k |W[n, k]| / 127,
q = round(W / scale) in [-127, 127] (an all-zero row gets scale 1). Activations stay float; the
kernel (csrc/int8_linear.c, beside this file) widens int8 to fp32 and accumulates in fp32.

Which path runs is chosen per call by the token count T of the batch:
* T <= max_tokens: the int8 kernel. It reads a quarter of the fp32 weight bytes, and decode-
  sized batches are weight-bandwidth bound, so it is the faster one there;
* T > max_tokens: a dense GEMM on the *dequantized* weight (q * scale), where the step is
  compute-bound (prefill chunks, Sarathi's budget-sized hybrid batches). Its dtype (`large`):
  - float32 by default: F.linear on a float copy of the dequantized weight, the same function
    as the int8 kernel up to fp32 summation order, so a request's greedy output does not depend
    on how many tokens shared its batch (tests/e2e/test_offline_api.py: every policy, token budget
    and preemption gives the same tokens);
  - bfloat16 when asked for (`--weight-quant int8-bf16`), worth it on CPUs with native bf16 dot
    products (AVX512_BF16 or AMX-BF16, where oneDNN's bf16 GEMMs beat fp32): activations are
    rounded to bf16 for the multiply, products accumulate in fp32, the output returns to the
    compute dtype. The bf16 copy of a dequantized int8 weight is exact up to bf16 rounding of
    q * scale (q has 8 significant bits, bf16 keeps 8). The price: bf16 rounding differs from
    the int8 kernel's fp32 arithmetic, so which batch carried a token can change a near-tie
    (greedy outputs then depend on load).
  Memory cost: the int8 copy beside the float weight (+25% of the fp32 bytes) and, with bf16,
  a bf16 copy (+50%). Dequantizing per large batch instead would re-expand every weight on every
  prefill step.

The threshold is recorded per CPU class in INT8_MAX_TOKENS by (int8 kernel SIMD path, large
path): a start-up measurement would make the chosen path, and so the numerics, depend on machine
load at start-up (measurements: bench/results/kernels/README.md).
A tied LM head shares its weight with the embedding table, so in int8 mode the embedding rows
are the dequantized ones too (the same quantized model throughout).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc.backends.base import LinearMethod
from worker_svc.backends.cpu import native

# (int8 kernel path, large path) -> the largest token count at which int8 beats the dense GEMM
# over a whole step; "scalar": never int8
INT8_MAX_TOKENS = {("avx2", "float32"): 64, ("avx2", "bfloat16"): 8}


def cpu_has_bf16_dot() -> bool:
    """Native bf16 dot products (AVX512_BF16 or AMX-BF16), where oneDNN's bf16 GEMM beats fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_large_note() -> str:
    """'' on CPUs with native bf16 dot products; else why int8-bf16 will be slow here."""
    return "" if cpu_has_bf16_dot() else "no AVX512_BF16/AMX on this CPU: the bf16 GEMM is emulated, slower than fp32"


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int8 contiguous, scale [N] fp32), w ~= q * scale[:, None]."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale.contiguous()


def default_max_tokens(large: torch.dtype = torch.float32) -> int:
    """The recorded threshold for this CPU's int8 kernel next to `large` (0 when the kernel is
    unavailable or scalar)."""
    if not native.available():
        return 0
    return INT8_MAX_TOKENS.get((native.int8_isa(), str(large).removeprefix("torch.")), 0)


class Int8LinearMethod(LinearMethod):
    """Weight-only int8 for batches of at most max_tokens rows; a dense GEMM in `large` dtype on
    the dequantized weight above (see module docstring). process() adds layer.qweight [N, K]
    int8 and layer.wscale [N] fp32, replaces layer.weight's values by their dequantized form and,
    when large is bf16, adds layer.weight_large (and bias_large) in bf16, except on layers with
    full_precision_output (the LM head: logits are not rounded to bf16)."""

    def __init__(self, max_tokens: int | None = None, large: torch.dtype | None = None):
        if not native.available():
            raise ValueError(f"weight quantization int8 needs the native kernels: {native.unavailable_reason()}")
        self.large = torch.float32 if large is None else large
        if self.large not in (torch.float32, torch.bfloat16):
            raise ValueError(f"large-batch GEMM dtype must be float32 or bfloat16, got {self.large}")
        self.max_tokens = default_max_tokens(self.large) if max_tokens is None else max_tokens
        note = bf16_large_note() if self.large == torch.bfloat16 else ""
        self.name = f"int8 for <= {self.max_tokens} tokens" + (
            ", bf16 GEMM above" if self.large == torch.bfloat16 else "") + (f" ({note})" if note else "")

    def process(self, layer: torch.nn.Module) -> None:
        if hasattr(layer, "qweight"):          # a weight shared by two layers: quantized once
            return
        q, scale = quantize_int8(layer.weight)
        layer.register_buffer("qweight", q, persistent=False)
        layer.register_buffer("wscale", scale, persistent=False)
        with torch.no_grad():
            layer.weight.copy_((q.float() * scale[:, None]).to(layer.weight.dtype))
        if layer.bias is not None:
            layer.register_buffer("bias_f32", layer.bias.detach().float().contiguous(), persistent=False)
        if self.large == torch.bfloat16 and not getattr(layer, "full_precision_output", False):
            layer.register_buffer("weight_large", layer.weight.detach().to(torch.bfloat16).contiguous(),
                                  persistent=False)
            if layer.bias is not None:
                layer.register_buffer("bias_large", layer.bias.detach().to(torch.bfloat16), persistent=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if rows.shape[0] > self.max_tokens or x.device.type != "cpu":
            if self.large == torch.bfloat16 and hasattr(layer, "weight_large"):
                b = None if bias is None else (
                    layer.bias_large if bias is layer.bias and hasattr(layer, "bias_large") else bias.bfloat16())
                return F.linear(x.to(torch.bfloat16), layer.weight_large, b).to(x.dtype)
            return F.linear(x, layer.weight, bias)
        b = None
        if bias is not None:
            b = layer.bias_f32 if bias is layer.bias and hasattr(layer, "bias_f32") else bias.float().contiguous()
        xf = rows if rows.dtype == torch.float32 else rows.float()
        if xf.stride(-1) != 1:
            xf = xf.contiguous()
        # qweight, wscale, bias_f32 were made contiguous fp32/int8 by process()
        y = native.int8_linear(xf, layer.qweight, layer.wscale, b, check=False)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
