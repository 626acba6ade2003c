"""The device seam: what differs per device, behind three small interfaces.

A DeviceBackend is chosen once per worker at start-up (worker_svc.backends.select_backend) and
handed to the model and the executor. The model code (layers, positions, the flat hybrid batch)
never asks which device it runs on; it calls

* backend.attention.build_metadata(...) once per batch and backend.attention.forward(...) per
  layer: write this step's K/V to their cache slots, then attend (prefill chunks with a cached
  prefix and single-token decodes in the same batch);
* backend.linear.process(layer) once after a linear layer's weights are set (quantize, repack)
  and backend.linear.apply(layer, x) per call;
* backend.kv_cache_dtype for the paged KV tensors (independent of the compute dtype);
* backend.ops for the elementwise glue of a layer (RMSNorm with the residual add, rotary,
  silu * up): Ops below is the torch reference (CUDA, fallbacks); the CPU backend's fused native
  versions equal it (worker_svc/backends/cpu.py, csrc/cpu_ops.c).

Adding a device (or a faster kernel for one) means adding a backend, not `if cuda` branches in
the model. describe() is the one line a worker prints at start-up so an operator knows what runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

# (start_pos, num_new_tokens, block_table) per sequence of a batch, in batch row order; the
# caller has checked that each block table covers start_pos + num_new_tokens.
SeqSpec = tuple[int, int, list[int]]


class AttentionBackend(Protocol):
    """Paged attention over a hybrid batch. Invariant: forward() writes the K/V of the batch's
    tokens to their slots before any query reads the cache, so a chunk sees its own keys."""

    name: str

    def build_metadata(self, seqs: list[SeqSpec], block_size: int,
                       device: torch.device | str) -> Any:
        """Everything every layer needs for one batch, built once per batch (not per layer)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Any, layer: int,
                meta: Any, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of this step's tokens (rotated) -> out [T, Hq, D]."""


class LinearMethod:
    """How a linear layer's weight is kept and multiplied: dense F.linear in the layer's dtype.

    A layer owns `weight` [out, in] (already sharded for tensor parallelism) and `bias` [out] or
    None. Subclasses may replace the stored form in process() (e.g. int8 + scales) and must keep
    apply(layer, x) == x @ W.T + b up to their stated tolerance.
    """

    name = "float"

    def process(self, layer: torch.nn.Module) -> None:
        """Called once after the layer's weights are set."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class Ops:
    """The elementwise ops between a decoder layer's linear layers and attention, written as Hugging
    Face's Llama computes them (the reference; what any device runs). A backend may replace them
    with fused kernels that compute the same function (fp32: the same roundings up to summation
    order and exp; see csrc/cpu_ops.c) and may work in place where stated.

    Tensors: x, residual [T, H]; weight [H]; q [T, Hq, D], k [T, Hkv, D]; cos, sin [T, 1, D] in
    the compute dtype (RotaryEmbedding.tables); gate_up [T, 2 * I] (gate, then up)."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * (x / sqrt(mean(x^2) + eps)), the normalisation in fp32, then cast to x's
        dtype before the weight multiply (HF LlamaRMSNorm)."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """r = residual + x (in x's dtype, as HF adds the residual); returns (rms_norm(r), r).
        An implementation may store r into residual's storage: callers use the returned r and
        never the residual they passed."""
        r = residual + x
        return self.rms_norm(r, weight, eps), r

    def rotary(self, q: torch.Tensor, k: torch.Tensor,
               cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(q * cos + rotate_half(q) * sin, the same for k); rotate_half(x) = cat(-x2, x1) of
        the two halves of a head (HF convention). An implementation may rotate in place."""
        cos, sin = cos_sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused gate_up projection's output [T, 2 * I] -> [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@dataclass
class DeviceBackend:
    """The per-device choices of one worker (see module docstring)."""

    device: torch.device
    attention: AttentionBackend
    linear: LinearMethod
    kv_cache_dtype: torch.dtype
    # sample where the logits are; only token ids cross to the host (worker_svc.device_sampler)
    sample_on_device: bool = False
    # KV blocks allocated beyond the scheduler's, ids num_blocks.. (CUDA graphs' padding rows
    # write there, so padding never touches a request's KV)
    scratch_blocks: int = 0
    # (model, cache, attention, sizes, scratch_block, device) -> a graph runner, or None
    make_graph_runner: Callable[..., Any] | None = None
    note: str = ""              # e.g. why a fallback was taken; printed by describe()
    ops: Ops = field(default_factory=Ops)     # the layers' elementwise glue (see Ops)

    def bind(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, q_dtype: torch.dtype,
             scale: float, max_pages: int) -> None:
        """Tell an attention backend that plans per batch (FlashInfer) the model's shapes."""
        bind = getattr(self.attention, "bind", None)
        if bind is not None:
            bind(num_qo_heads, num_kv_heads, head_dim, q_dtype, scale, max_pages)

    def describe(self) -> str:
        """One line, e.g. "device cpu: attention native avx2, kv bfloat16, linear int8 for <= 16
        tokens"; also ModelInfo.backend, shown as a /metrics label by the scheduler."""
        kv = str(self.kv_cache_dtype).removeprefix("torch.")
        return (f"device {self.device}: attention {self.attention.name}, kv {kv}, "
                f"linear {self.linear.name}"
                + (f", ops {self.ops.name}" if self.ops.name != "torch" else "")
                + (", sampling on device" if self.sample_on_device else "")
                + (f" ({self.note})" if self.note else ""))
