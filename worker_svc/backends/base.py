"""The device seam: what differs per device, behind small interfaces.

A DeviceBackend is chosen once per worker at start-up (worker_svc.backends.select_backend) and
handed to the model and the model runner. The model code (layers, positions, the flat hybrid batch)
never asks which device it runs on; it calls

* backend.attention.build_metadata(...) once per batch and backend.attention.forward(...) per
  layer: write this step's K/V to their cache slots, then attend (prefill chunks with a cached
  prefix and single-token decodes in the same batch);
* backend.linear.process(layer) once after a linear layer's weights are set (quantize, repack)
  and backend.linear.apply(layer, x) per call;
* backend.kv_cache_dtype for the paged KV tensors (independent of the compute dtype);
* backend.ops for the elementwise glue of a layer (RMSNorm with the residual add, rotary,
  silu * up): Ops below is the torch reference (CUDA, fallbacks); the CPU backend's fused native
  versions equal it (worker_svc/backends/cpu/backend.py, cpu/csrc/cpu_ops.c).

The model runner (worker_svc.model_runner: check, forward, sample) asks the backend what it would otherwise
decide by device string: the compute dtype for "auto" (compute_dtype, from default_dtype), the
KV capacity when none was given (num_kv_blocks), the sampler (sampler: on the host, or on the
device with the host as fallback), the graph runner for decode batches (graph_runner; it builds
its own attention metadata from the batch), and the torch.distributed backend (dist_backend).

Adding a device (or a faster kernel for one) means adding a backend, not `if cuda` branches in
the model or the model runner. describe() is the one line a worker prints at start-up so an operator
knows what runs. Device code (native libraries, CUDA, FlashInfer) lives only under
worker_svc/backends/ (tests/test_layering.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Protocol

import torch
import torch.nn.functional as F

from shared.config import WorkerConfig
from worker_svc.kv_cache import PagedKVCache
from worker_svc.model_config import ModelConfig
from worker_svc.sampling import Sampler, TokenSampler

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
    order and exp; see cpu/csrc/cpu_ops.c) and may work in place where stated.

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
        An implementation may store r into residual's storage and rms_norm(r) into x's: callers
        use the returned tensors and never the x or residual they passed."""
        r = residual + x
        return self.rms_norm(r, weight, eps), r

    def rope_inputs(self, rope, positions: torch.Tensor, dtype: torch.dtype):
        """What rotary() takes for a batch at positions [T] (int64), computed once per batch:
        the reference's cos, sin [T, 1, D] in `dtype` (rope: the model's RotaryEmbedding). A
        backend whose rotary kernel reads the table itself returns its own (positions + table)."""
        return rope.tables(positions, dtype)

    def rotary(self, q: torch.Tensor, k: torch.Tensor,
               cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(q * cos + rotate_half(q) * sin, the same for k); rotate_half(x) = cat(-x2, x1) of
        the two halves of a head (HF convention); cos_sin: what rope_inputs() returned. An
        implementation may rotate in place."""
        cos, sin = cos_sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused gate_up projection's output [T, 2 * I] -> [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Readback:
    """A device -> host copy started by DeviceBackend.read_back: wait() gives the values
    (blocking until the copy has run), ready() says, without waiting, whether wait() would
    return at once, block() waits for that without reading (a waiter thread: the CUDA event's
    wait releases the GIL; the default polls ready())."""

    def __init__(self, wait: Callable[[], list], ready: Callable[[], bool] = lambda: True,
                 block: Callable[[], None] | None = None):
        self.wait, self.ready = wait, ready
        self._block = block

    def block(self) -> None:
        if self._block is not None:
            self._block()
            return
        while not self.ready():
            time.sleep(0.0005)


class GraphRunner(Protocol):
    """Replays captured graphs of the model for the batches it can run (CUDA graphs for
    decode-only batches). It builds the attention metadata of a batch itself."""

    def run(self, seqs: list[SeqSpec], token_ids: list[int], positions: list[int],
            patch: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """Logits [len(seqs), V] float32 on the device of every sequence's last token, or None
        when it cannot run this batch (the caller runs it eagerly). token_ids, positions: the
        batch's flat rows [T]. patch(ids): called with the device row of token ids once they
        are in place, before the replay (tokens still on the device: async scheduling). The
        result may be overwritten by the next run()."""


@dataclass
class DeviceBackend:
    """The per-device choices of one worker (see module docstring). A device's subclass sets the
    class-level answers (default_dtype, dist_backend) and implements num_kv_blocks; sampler()
    and graph_runner() default to the host sampler and no graphs."""

    device: torch.device
    attention: AttentionBackend
    linear: LinearMethod
    kv_cache_dtype: torch.dtype
    compute_dtype: torch.dtype      # weights and activations; default_dtype unless one was asked for
    # KV blocks allocated beyond the scheduler's, ids num_blocks.. (CUDA graphs' padding rows
    # write there, so padding never touches a request's KV)
    scratch_blocks: int = 0
    note: str = ""              # e.g. why a fallback was taken; printed by describe()
    ops: Ops = field(default_factory=Ops)     # the layers' elementwise glue (see Ops)

    default_dtype: ClassVar[torch.dtype]    # the compute dtype for dtype "auto"
    dist_backend: ClassVar[str]             # torch.distributed backend between ranks (TP, PP)
    # sample where the logits are; only token ids cross to the host (see sampler())
    sample_on_device: ClassVar[bool] = False

    def bind(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, q_dtype: torch.dtype,
             scale: float, max_pages: int) -> None:
        """Tell an attention backend that plans per batch (FlashInfer) the model's shapes."""
        bind = getattr(self.attention, "bind", None)
        if bind is not None:
            bind(num_qo_heads, num_kv_heads, head_dim, q_dtype, scale, max_pages)

    def num_kv_blocks(self, model: torch.nn.Module, cfg: ModelConfig, num_kv_heads: int,
                      block_size: int, config: WorkerConfig, distributed: bool) -> int:
        """KV blocks per layer to allocate when config.cache.num_blocks is 0 ("auto"), the
        scheduler's only (scratch_blocks come on top). num_kv_heads: this rank's; distributed:
        this rank is one of several (TP/PP). Called after bind(), before the cache exists."""
        raise NotImplementedError(f"{type(self).__name__} cannot size the KV cache: give num_blocks")

    def sampler(self, seed: int | None, eos_token_ids: list[int] | tuple) -> TokenSampler:
        """The sampler for this device's logits; seed: the worker's (None: from the OS)."""
        return Sampler(seed, eos_token_ids=eos_token_ids)

    def graph_runner(self, model: torch.nn.Module, cache: PagedKVCache,
                     max_num_seqs: int) -> GraphRunner | None:
        """Graphs of `model` over `cache` (allocated with scratch_blocks on top of the
        scheduler's blocks) for batches of up to max_num_seqs sequences, or None (run eagerly)."""
        return None

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on this backend's device, copied without waiting for the work already
        queued there (the model runner prepares batch n + 1 while batch n runs: async
        scheduling). The host tensor may be changed or dropped once this returns."""
        return t.to(self.device)

    def read_back(self, t: torch.Tensor) -> "Readback":
        """Start copying the device tensor t to the host; its Readback waits for that copy alone
        (not for work queued after it) and gives t.tolist()."""
        return Readback(t.tolist)

    def layer_stack(self, layers: torch.nn.ModuleList):
        """A callable that runs a batch through all of `layers` (a single rank's DecoderLayers)
        at once, or None: the model calls each layer. Called once per model; the callable takes
        (x, cos_sin, cache, meta) and returns DecoderLayer.forward's (x, residual) of the last
        layer, or None for a batch it does not run (the model then runs the layers itself)."""
        return None

    def describe(self) -> str:
        """One line, e.g. "device cpu: attention native avx2, kv bfloat16, linear int8 for <= 16
        tokens"; also ModelInfo.backend, shown as a /metrics label by the scheduler."""
        kv = str(self.kv_cache_dtype).removeprefix("torch.")
        return (f"device {self.device}: attention {self.attention.name}, kv {kv}, "
                f"linear {self.linear.name}"
                + (f", ops {self.ops.name}" if self.ops.name != "torch" else "")
                + (", sampling on device" if self.sample_on_device else "")
                + (f" ({self.note})" if self.note else ""))
