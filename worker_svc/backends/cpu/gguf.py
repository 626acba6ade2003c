"""Linear layers on the GGUF file's own quantized blocks (CPU), behind the LinearMethod seam.

A GGUF model is served as the file defines it: no re-quantization. A layer whose weight carries
the file's blocks (layer.gguf, see worker_svc/gguf_blocks.py) in a format with a block
kernel (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K: csrc/gguf_*.c) runs a kernel that reads the file's
bytes. Layers without blocks (float checkpoints, GGUF tensors stored as F32/F16, formats without a
kernel, dequantized at load with a log line) run plain F.linear, as does any non-fp32 layer.

Arithmetic (`dot`, DOTS, SARATHI_GGUF_DOT). All three read the file's weights unchanged and differ
in the activations' precision only:
* "int8x2" (the default): each token's activations quantized once per call to blocks of 32 in
  two 8-bit parts (~15 bits a value), integer dots with the file's quants, the file's scales
  applied in fp32 (within amax / 32512 per block of F.linear on the exact dequantization);
* "int8": llama.cpp's method, one 8-bit part;
* "fp32": the exact kernel, F.linear on the dequantized weights up to fp32 summation order.
A token's activations are quantized alone, so its output never depends on the other tokens of
its call (batch independence).

Which calls take the block kernel (max_tokens, default_max_tokens):
* with an integer dot on the lane kernels (the default on AVX-512 VNNI and AVX2 builds): every
  call (EVERY_T), a prefill chunk too. One arithmetic for every batch size, so a token's linear
  outputs are the same in every batch without exception, and no float weight is kept
  (large="dequant"). On AVX2 builds this costs long prefill chunks some speed against the float
  GEMM, for faster decodes, less memory and replays that repeat their first run (below);
* on the tile kernels (SARATHI_GGUF_LANES=0), calls of at most GGUF_MAX_TOKENS tokens, the
  float GEMM above (the scalar build: the float GEMM for every call).
Where there is a threshold, the two paths differ by the small-batch path's activation rounding
and summation order: it is the one exception to batch independence of the linear layers.

Kernels (`lanes`, default_lanes, SARATHI_GGUF_LANES): the integer dots run on the lane kernels
(rows in a vector's lanes for small calls, tokens above) or on the 8-token tile kernels. Both keep
a token's result independent of its batch; each has its own fp32 summation order, and the lane
kernels have one order for every call size and both SIMD builds (the AVX2 build's outputs are the
VNNI build's bits). They are the default wherever built. A replayed request (a scheduler
restart recomputes its generated tokens in prefill steps) gets the decode's linear bits only
without a threshold: with one, the recomputation runs the float GEMM and a near-tie turns into
another word (the scheduler-SIGKILL replay test did, on the tile kernels and on lanes with a
threshold alike). Prefill attention still sums in another order than the decode kernel, so the
replay's logits match in all but the last bits (tests/worker/test_gguf_engine.py shows both).
SARATHI_GGUF_LANES=0 keeps the tile kernels (and their threshold) everywhere.

Memory of the large path (where there is a threshold): large="cached" (the default there) keeps
the float weight (the model holds it anyway: 4 bytes a weight beside the file's blocks);
large="dequant" drops it and dequantizes the blocks into a per-call buffer on every large call
(memory of the blocks only, plus one layer's float weight at a time, at the cost of a
dequantization of every weight per large step). Without a threshold large="dequant" is the
default and the per-call dequantization only serves a non-fp32 or non-CPU x. A tied LM head keeps
its float weight in both modes: the embedding lookup reads it.

Accuracy against Hugging Face and the kernels' timings: bench/results/kernels/README.md.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from worker_svc.backends.base import LinearMethod
from worker_svc.backends.cpu import native

# By the block kernels' SIMD path: the largest call (tokens) at which the block kernel beats F.linear
# on the float weight at every T of a whole step. Recorded per CPU class, not measured at start-up
# (that would make the numerics depend on the machine's load then); "scalar": never.
GGUF_MAX_TOKENS = {"avx2": 48}
# VNNI builds with an integer dot on the lane kernels have no threshold: those kernels beat F.linear
# on the float weight at every T measured, and one arithmetic and one fp32 summation order for
# every call means a request replayed after a preemption or a scheduler restart recomputes its
# tokens in large prefill steps with the arithmetic that first decoded them
EVERY_T = sys.maxsize   # max_tokens meaning: the block kernel at every T


# The small-batch kernel's arithmetic (module docstring; SARATHI_GGUF_DOT overrides the default):
# "int8x2" (csrc/gguf_q8.c gguf_linear_q8, parts 2), "int8" (parts 1), "fp32" (csrc/gguf_linear.c)
DOTS = ("int8x2", "int8", "fp32")
DEFAULT_DOT = "int8x2"
DOT_PARTS = {"int8": 1, "int8x2": 2}   # integer-dot arithmetics: 8-bit parts per activation


def lanes_setting() -> str:
    """SARATHI_GGUF_LANES: "auto" (unset), "1" or "0" (anything else is refused)."""
    v = os.environ.get("SARATHI_GGUF_LANES", "auto")
    if v not in ("0", "1", "auto"):
        raise ValueError(f"SARATHI_GGUF_LANES must be 0, 1 or auto, got {v!r}")
    return v


def default_lanes() -> bool:
    """SARATHI_GGUF_LANES: unset (or "auto") or 1, the integer-dot path's lane kernels wherever
    built (AVX-512 VNNI and AVX2 builds), at every call; 0: the 8-token tile kernels below
    GGUF_MAX_TOKENS. Both keep a token's result independent of its batch; they differ from each
    other in fp32 summation order (last bits)."""
    return lanes_setting() != "0"


def default_max_tokens(dot: str | None = None, lanes: bool | None = None) -> int:
    """The block kernel's token limit on this machine for this arithmetic (dot, default
    default_dot(); lanes, default default_lanes()): EVERY_T with an integer dot on the lane kernels
    (VNNI or AVX2 builds), GGUF_MAX_TOKENS on the tile kernels (0 without the native library)."""
    if not native.available():
        return 0
    dot = default_dot() if dot is None else dot
    lanes = default_lanes() if lanes is None else lanes
    if dot in DOT_PARTS and lanes and native.gguf_q8_lanes():
        return EVERY_T
    return GGUF_MAX_TOKENS.get(native.gguf_isa(), 0)


def default_dot() -> str:
    dot = os.environ.get("SARATHI_GGUF_DOT", DEFAULT_DOT)
    if dot not in DOTS:
        raise ValueError(f"SARATHI_GGUF_DOT must be one of {DOTS}, got {dot!r}")
    return dot


class GgufLinearMethod(LinearMethod):
    """Block kernel for T <= max_tokens (EVERY_T: every call), float GEMM above (module docstring).
    process() keeps layer.gguf's blocks as buffer layer.gguf_data (uint8 [N, row_bytes]) and
    layer.gguf_type; large: None = "dequant" without a threshold, "cached" with one."""

    def __init__(self, max_tokens: int | None = None, large: str | None = None, dot: str | None = None,
                 lanes: bool | None = None):
        if not native.available():
            raise ValueError(f"GGUF block kernels need the native library: {native.unavailable_reason()}")
        if large not in (None, "cached", "dequant"):
            raise ValueError(f"large must be 'cached' or 'dequant', got {large!r}")
        self.dot = default_dot() if dot is None else dot
        if self.dot not in DOTS:
            raise ValueError(f"dot must be one of {DOTS}, got {self.dot!r}")
        # the lane kernels only where they exist and the dot is an integer one
        self.lanes = bool(default_lanes() if lanes is None else lanes) and self.dot in DOT_PARTS \
            and native.gguf_q8_lanes()
        self.max_tokens = default_max_tokens(self.dot, self.lanes) if max_tokens is None else max_tokens
        # no threshold: no float weight to keep (the per-call dequantization is the fallback for
        # a non-fp32 or non-CPU x only)
        self.large = large or ("dequant" if self.max_tokens == EVERY_T else "cached")
        isa = f"{native.gguf_q8_isa()} {self.dot} dot" if self.dot in DOT_PARTS else native.gguf_isa() + " fp32 dot"
        if self.lanes:
            isa += ", lane kernels"
        if self.max_tokens == EVERY_T:
            self.name = f"gguf blocks ({isa}) at every batch size"
        else:
            self.name = f"gguf blocks ({isa}) for <= {self.max_tokens} tokens, float GEMM above" + (
                " (dequantized per call)" if self.large == "dequant" else "")

    def process(self, layer: torch.nn.Module) -> None:
        blocks = getattr(layer, "gguf", None)
        if blocks is None or hasattr(layer, "gguf_data") or layer.weight.dtype != torch.float32 \
                or not native.gguf_supports(blocks.ggml_type) or tuple(layer.weight.shape) != (
                    blocks.data.shape[0], blocks.cols):
            return
        layer.register_buffer("gguf_data", blocks.data.contiguous(), persistent=False)
        layer.gguf_type = blocks.ggml_type
        if layer.bias is not None:
            layer.register_buffer("bias_f32", layer.bias.detach().float().contiguous(), persistent=False)
        if self.large == "dequant" and not getattr(layer, "full_precision_output", False):
            layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        data = getattr(layer, "gguf_data", None)
        if data is None:
            return F.linear(x, layer.weight, bias)
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        K = rows.shape[1]
        if rows.shape[0] > self.max_tokens or x.dtype != torch.float32 or x.device.type != "cpu":
            w = layer.weight
            if w.numel() == 0:      # large="dequant": this call's float weight, from the blocks
                w = native.gguf_dequantize(layer.gguf_type, data, K)
            return F.linear(x, w, bias)
        b = None
        if bias is not None:
            b = layer.bias_f32 if bias is layer.bias else bias.float().contiguous()
        xf = rows if rows.stride(-1) == 1 else rows.contiguous()
        if self.dot == "fp32":
            y = native.gguf_linear(layer.gguf_type, data, xf, b, check=False)
        else:
            y = native.gguf_linear_q8(layer.gguf_type, data, xf, b, parts=DOT_PARTS[self.dot], lanes=self.lanes,
                                      check=False)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


class GroupInt8LinearMethod(GgufLinearMethod):
    """`--weight-quant int8`: every linear weight re-quantized to int8 with one scale per group of
    32 columns, stored as GGUF Q8_0 blocks (llama.cpp's own int8 format: an fp16 scale
    max|w| / 127 per 32 weights, 1.06 bytes a weight, quantized by the gguf package's reference
    quantizer) and run on the Q8_0 block kernel, at every T on VNNI builds (then only the blocks
    are kept), elsewhere for small batches with an fp32 GEMM on the dequantized values above
    (layer.weight is replaced by them: both paths compute one model).
    A group of 32 tracks the weights' local range far better than one scale per row, at the
    memory of a per-64 fp32-scale scheme. Layers whose K is not a multiple of 32 keep float
    weights."""

    def __init__(self, max_tokens: int | None = None, dot: str | None = None):
        super().__init__(max_tokens, dot=dot)
        self.name = "int8 per 32-column group (Q8_0 blocks) " + self.name.removeprefix("gguf blocks ")

    def process(self, layer: torch.nn.Module) -> None:
        if hasattr(layer, "gguf_data"):       # a weight shared by two layers: quantized once
            return
        w = layer.weight
        if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % 32:
            return
        import gguf
        import numpy as np

        from worker_svc.gguf_blocks import GgufBlocks

        q8 = gguf.GGMLQuantizationType.Q8_0
        raw = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w.detach().numpy(), q8)))
        with torch.no_grad():
            w.copy_(native.gguf_dequantize(int(q8), raw, w.shape[1]))
        layer.gguf = GgufBlocks(int(q8), raw, w.shape[1])
        super().process(layer)
