"""Weight-only int8 linear layers for decode-heavy batches (CPU), behind the LinearMethod seam.

Quantization: symmetric, one fp32 scale per output row: scale[n] = max_k |W[n, k]| / 127,
q = round(W / scale) in [-127, 127] (an all-zero row gets scale 1). Activations stay float; the
kernel (worker_svc/csrc/int8_linear.c) widens int8 to fp32 and accumulates in fp32.

Which path runs is chosen per call by the token count T of the batch:
* T <= max_tokens: the int8 kernel. It reads a quarter of the fp32 weight bytes, and decode-
  sized batches are weight-bandwidth bound, so it is ~3x faster there;
* T > max_tokens: F.linear on a float copy of the *dequantized* weight (q * scale): the float
  GEMM is faster once the step is compute-bound (prefill chunks), and because it multiplies the
  same quantized weights, both paths compute the same function up to fp32 summation order: a
  request's output does not depend on how many tokens shared its batch, any more than in fp32.
  Memory cost: the int8 copy beside the float one, +25% of the fp32 weight bytes (SmolLM2-135M:
  +135 MB on 538 MB). Dequantizing per large batch instead would save that but re-expand
  every weight on every prefill step (~540 MB written per step).

The threshold comes from a measurement on each CPU class, recorded in INT8_MAX_TOKENS by the
int8 kernel's SIMD path (bench/int8_linear.py -> bench/results/int8_linear_amd.json): a start-up
measurement would make the chosen path, and so the numerics, depend on machine load at start-up.
A tied LM head shares its weight with the embedding table, so in int8 mode the embedding rows
are the dequantized ones too (the same quantized model throughout).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc import native
from worker_svc.backends.base import LinearMethod

# int8 kernel path -> largest token count at which int8 beats the float GEMM over a whole
# SmolLM2 step (bench/results/int8_linear_amd.json, 2 threads, AMD EPYC Zen 3: faster at every
# T <= 64, slower at 128; torch's sgemm is slow for skinny matrices on this CPU). "scalar": never.
INT8_MAX_TOKENS = {"avx2": 64, "scalar": 0}


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int8 contiguous, scale [N] fp32), w ~= q * scale[:, None]."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale.contiguous()


def default_max_tokens() -> int:
    """The recorded threshold for this CPU's int8 kernel (0 when the kernel is unavailable)."""
    return INT8_MAX_TOKENS.get(native.int8_isa(), 0) if native.available() else 0


class Int8LinearMethod(LinearMethod):
    """Weight-only int8 for batches of at most max_tokens rows; float GEMM on the dequantized
    weight above (see module docstring). process() adds layer.qweight [N, K] int8 and
    layer.wscale [N] fp32 and replaces layer.weight's values by their dequantized form."""

    def __init__(self, max_tokens: int | None = None):
        if not native.available():
            raise ValueError(f"weight quantization int8 needs the native kernels: {native.unavailable_reason()}")
        self.max_tokens = default_max_tokens() if max_tokens is None else max_tokens
        self.name = f"int8 for <= {self.max_tokens} tokens"

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

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if rows.shape[0] > self.max_tokens or x.device.type != "cpu":
            return F.linear(x, layer.weight, bias)
        b = None
        if bias is not None:
            b = layer.bias_f32 if bias is layer.bias and hasattr(layer, "bias_f32") else bias.float().contiguous()
        xf = rows if rows.dtype == torch.float32 else rows.float()
        if xf.stride(-1) != 1:
            xf = xf.contiguous()
        # qweight, wscale, bias_f32 were made contiguous fp32/int8 by process()
        y = native.int8_linear_unchecked(xf, layer.qweight, layer.wscale, b)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
