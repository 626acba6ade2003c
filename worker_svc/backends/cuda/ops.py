"""The layers' elementwise glue on FlashInfer's fused kernels (the CUDA backend's Ops).

Eager torch spends about 25 small kernels a layer on RMSNorm (fp32 upcast, square, mean, rsqrt,
two multiplies, downcast), the residual add, rotate_half rotary and silu * up. At decode sizes each
is a launch that moves a few kilobytes: together they cost more than the layer's attention, and
in eager (hybrid) batches the host time to launch them is what bounds the step. FlashInfer has a
fused kernel for each: rmsnorm, fused_add_rmsnorm (residual add + norm), silu_and_mul and rotary
from a cos/sin table (apply_rope_with_cos_sin_cache_inplace), four launches a layer instead.

Same functions as Ops (the HF reference), different roundings: the kernels keep fp32 through
the normalisation and the weight multiply and round once (HF rounds the normalised value to the
compute dtype before the weight multiply), add the residual in fp32, and rotate with the fp32
cos/sin table (HF casts the table to the compute dtype first). The table is the model's own
(RotaryEmbedding: every rope scaling it supports), so positions match the torch path exactly.

In place, as Ops' contract allows: add_rms_norm writes r into residual's storage and the
normalised rows into x's; rotary rotates q and k where they are (views of the fused qkv output).
FlashInfer is imported when this backend is built (a CUDA worker with FlashInfer only).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from worker_svc.backends.base import Ops


class RopePositions(NamedTuple):
    """What rotary() needs per batch: positions [T] int64 and the model's cos/sin table
    [max_positions, head_dim] float32 (cos in the first half, sin in the second)."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor


class FlashInferOps(Ops):
    """Ops on FlashInfer's fused kernels for 2-D rows in bf16/fp16 (what the model makes);
    anything else (fp32, other layouts) takes the torch reference."""

    name = "flashinfer"
    dtypes = (torch.bfloat16, torch.float16)

    def __init__(self):
        import flashinfer  # the optional [gpu] extra

        self.fi = flashinfer

    def _fits(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        # no rows (a batch with no row due a token reaches the final norm empty): the kernels
        # refuse a zero-sized launch, the reference returns the empty result
        return (x.dtype in self.dtypes and x.dim() == 2 and x.shape[0] > 0 and x.is_contiguous()
                and weight.dtype == x.dtype and weight.shape == x.shape[1:])

    def rms_norm(self, x, weight, eps):
        if self._fits(x, weight):
            return self.fi.rmsnorm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if self._fits(x, weight) and residual.shape == x.shape and residual.dtype == x.dtype \
                and residual.is_contiguous():
            self.fi.fused_add_rmsnorm(x, residual, weight, eps)
            return x, residual
        return super().add_rms_norm(x, residual, weight, eps)

    def rope_inputs(self, rope, positions, dtype):
        if dtype in self.dtypes:
            return RopePositions(positions, rope.cos_sin_cache())
        return super().rope_inputs(rope, positions, dtype)

    def rotary(self, q, k, cos_sin):
        if isinstance(cos_sin, RopePositions):
            if q.shape[0] > 0 and q.stride(-1) == 1 and k.stride(-1) == 1 and q.dtype == k.dtype:
                self.fi.apply_rope_with_cos_sin_cache_inplace(
                    cos_sin.positions, q, k, q.shape[-1], cos_sin.cos_sin_cache, is_neox=True)
                return q, k
            return super().rotary(q, k, tables(cos_sin, q.dtype))
        return super().rotary(q, k, cos_sin)

    def silu_mul(self, gate_up):
        if gate_up.dtype in self.dtypes and gate_up.dim() == 2 and gate_up.shape[0] > 0 and gate_up.is_contiguous() \
                and (gate_up.shape[1] * gate_up.element_size()) % 32 == 0:
            return self.fi.silu_and_mul(gate_up)
        return super().silu_mul(gate_up)


def tables(rp: RopePositions, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's (cos, sin) [T, 1, D] from a RopePositions (the fallback path)."""
    half = rp.cos_sin_cache.shape[1] // 2
    cs = rp.cos_sin_cache[rp.positions]
    cos, sin = cs[:, :half], cs[:, half:]
    return (torch.cat([cos, cos], -1).unsqueeze(1).to(dtype), torch.cat([sin, sin], -1).unsqueeze(1).to(dtype))
