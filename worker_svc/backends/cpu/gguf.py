"""Linear layers on the GGUF file's own quantized blocks (CPU), behind the LinearMethod seam.

A GGUF model is served as the file defines it: no re-quantization. Layers whose weight carries
the file's blocks (layer.gguf, see worker_svc/model/gguf_blocks.py) in a format with a block
kernel (csrc/gguf_linear.c: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) run a block kernel reading the
file's bytes (Q4_1: 5 bits a weight, 1/6.4 of fp32). Its arithmetic (`dot`, DOTS below): by
default "int8x2", llama.cpp's integer-dot method with a finer activation: each token's
activations quantized once per call to blocks of 32 in two 8-bit parts (~15 bits a value),
integer dots with the file's quants (AVX-512 VNNI vpdpbusd, or AVX2 maddubs), the file's scales
applied in fp32. Which calls take it (max_tokens, default_max_tokens):
* AVX-512 VNNI builds, integer dot on the lane kernels (the default there): every call, a
  512-token prefill chunk too (EVERY_T: the lane kernels beat the fp32 GEMM at every T measured,
  2.6-3.9x at 32-512 tokens on Zen 5). One arithmetic for all, so a token's result is the same in
  every batch without exception, and no float weights are kept (large="dequant": the model holds
  the file's blocks, plus the LM head's float weight where the embedding is tied to it).
* elsewhere, T <= GGUF_MAX_TOKENS rows (decode-sized batches) the block kernel, T above (prefill
  chunks, large hybrid batches) F.linear on the exactly dequantized float weight layer.weight (the
  loader's dequantization, bit-identical to the kernels'). The two use the file's weights
  unchanged; they differ by the small-batch path's activation rounding (int8x2: within
  amax / 32512 per block of 32; "fp32": none, only summation order) and summation order: the
  threshold switch is the one exception to batch independence (a token's activations are
  quantized alone, so below it its output does not depend on the other tokens of its batch).
The integer dots run on the lane kernels (SARATHI_GGUF_LANES; default_lanes): 8 rows in a
vector's lanes for small calls (1-16 tokens on AVX-512 VNNI builds, 1-8 on AVX2 ones), tokens in a
vector's lanes above (16 a zmm, 8 a ymm), one fp32 summation order for all of them and for both
builds (the AVX2 build's outputs are the VNNI build's bits: tests/worker/test_gguf_kernels.py), so
a token's result stays bit-identical in every batch (SmolLM2's linear layers, against the 8-token
tile kernels: 1.19x faster at 1 token, 1.3-1.5x at 2-24, 1.64x at 32 on Zen 4 with VNNI,
bench/results/kernels/gguf_kernels_zen4.json; with AVX2 only: 1.23x at 1-2, 1.0-1.2x at 4-48 but
0.86x at 12, bench/results/kernels/gguf_kernels_zen4_avx2.json).
By default they run where the build has VNNI; AVX2 builds keep the 8-token tile kernels (their
own summation order, also batch-independent) unless SARATHI_GGUF_LANES=1: with the AVX2 lanes,
tests/e2e/test_serving.py's scheduler-SIGKILL replay ended one of its 16 greedy requests with
another word than the offline run ("a place" for "a land"), in both runs (the suite, then alone;
on the tile kernels it passes).
Most likely cause (not traced): the replay recomputes the generated tokens in prefill steps of
more than GGUF_MAX_TOKENS (16 requests' prompts and tokens), on the float GEMM, where they were
first decoded on the integer dots: the threshold switch, which a near-tie in that request turns
into another word with these last bits and not with the tiles'. SARATHI_GGUF_LANES=0 keeps the
tile kernels (and the threshold) everywhere.
Measured on SmolLM2's Q4_1 GGUF against Hugging Face (teacher-forced, 33
positions, bench/results/kernels/weight_quant_agreement.json): int8x2 top-1 agreement 1.000, max
logit error 0.01% of the logit range; "int8" (llama.cpp's own 8-bit activations) 0.909, 1.5%;
"fp32" 1.000, 0. With every call on the lane kernels (Zen 5, weight_quant_agreement_zen5.json):
int8x2 1.000, 0.013%; int8 0.970, 2.1%.

Large path memory (where there is a threshold): large="cached" (the default there) keeps the
float weight (the model holds it anyway: 4 bytes a weight beside the file's blocks);
large="dequant" drops it and dequantizes the blocks into a per-call buffer on every large call
(memory of the blocks only, plus one layer's float weight at a time; costs a dequantization of
every weight per large step: measured in bench/gguf_kernels.py, bench/results/kernels/README.md).
Without a threshold large="dequant" is the default and the per-call dequantization only serves a
non-fp32 or non-CPU x. A tied LM head keeps its float weight in both modes: the embedding lookup
reads it.

Layers without blocks (float checkpoints, GGUF tensors stored as F32/F16, formats without a
kernel, dequantized at load with a log line) run plain F.linear, as does any non-fp32 layer.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from worker_svc.backends.base import LinearMethod
from worker_svc.backends.cpu import native

# largest T at which the block kernel beats F.linear on the float weight at every T over a SmolLM2
# (Q4_1) step. The int8x2 kernel with 8-token tiles (bench/results/kernels/gguf_tile_zen3.json,
# AMD EPYC family 25 model 1, Zen 3, 2 threads): 81.5 vs 127 ms at T=32 (the 4-token-tile kernel
# before: 127 ms, a tie), 122 vs 127 at T=48, 164 vs 153 at 64: 48. (Before: 32, from
# gguf_kernels_amd.json and gguf_kernels_zen4.json with the older kernels.) "scalar": never.
GGUF_MAX_TOKENS = {"avx2": 48}
# The VNNI lane kernels (SARATHI_GGUF_LANES: csrc/gguf_linear.c rl_rows, tl_rows) beat F.linear on
# the float weight at every T measured: 1.4-2.0x at 49-256 on Zen 4 (bench/results/kernels/
# gguf_kernels_zen4.json, AMD EPYC family 25 model 17), 2.6-3.9x at 32-512 on Zen 5 (gguf_kernels_zen5.json,
# family 26 model 2), 2 threads. So a VNNI build with an integer dot and the lane kernels has no
# threshold: every call, a 512-token prefill chunk too, runs on the file's blocks with one arithmetic
# and one fp32 summation order, and a token's result is the same in every batch without exception
# (a request replayed after a preemption or a scheduler restart recomputes its tokens in large
# prefill steps with the very arithmetic that first decoded them). It also needs no float weights
# (large="dequant" by default there: the model keeps the file's blocks only).
EVERY_T = sys.maxsize   # max_tokens meaning: the block kernel at every T


# The small-batch kernel's arithmetic (SARATHI_GGUF_DOT overrides the default):
# * "int8" = llama.cpp's method: each token's activations quantized once per call to 8-bit blocks
#   of 32 (scale amax / 127), integer dots with the file's blocks (vpdpbusd / maddubs;
#   csrc/gguf_linear.c gguf_linear_q8), fp32 scales;
# * "int8x2": the same plus a second 8-bit part holding the rounding remainder in 1/128 steps
#   (x ~ d (q + q_lo / 128): ~15-bit activations), two integer dots per run of 32;
# * "fp32": the exact path (each row dequantized in cache, fp32 dots: F.linear on the file's
#   dequantized weights up to summation order).
# All three read the file's own blocks; they differ in the activations' precision only.
DOTS = ("int8x2", "int8", "fp32")
DEFAULT_DOT = "int8x2"
DOT_PARTS = {"int8": 1, "int8x2": 2}   # integer-dot arithmetics: 8-bit parts per activation


def default_lanes() -> bool:
    """SARATHI_GGUF_LANES: unset (or "auto"), the integer-dot path's lane kernels on AVX-512 VNNI
    builds and the 8-token tile kernels on AVX2 ones (see the module docstring); 1: the lane
    kernels wherever built (AVX2 too); 0: the tile kernels. Both keep a token's result independent
    of its batch; they differ from each other in fp32 summation order (last bits)."""
    v = os.environ.get("SARATHI_GGUF_LANES", "auto")
    if v not in ("0", "1", "auto"):
        raise ValueError(f"SARATHI_GGUF_LANES must be 0, 1 or auto, got {v!r}")
    return v == "1" or (v == "auto" and native.gguf_q8_isa() == "avx512vnni")


def default_max_tokens(dot: str | None = None, lanes: bool | None = None) -> int:
    """The block kernel's token limit on this machine for this arithmetic (dot, default
    default_dot(); lanes, default default_lanes()): EVERY_T on VNNI builds with an integer dot on
    the lane kernels, GGUF_MAX_TOKENS elsewhere (0 without the native library)."""
    if not native.available():
        return 0
    dot = default_dot() if dot is None else dot
    lanes = default_lanes() if lanes is None else lanes
    if dot in DOT_PARTS and lanes and native.gguf_q8_lanes() and native.gguf_q8_isa() == "avx512vnni":
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
            y = native.gguf_linear_unchecked(layer.gguf_type, data, xf, b)
        else:
            y = native.gguf_linear_q8_unchecked(layer.gguf_type, data, xf, b, parts=DOT_PARTS[self.dot],
                                                lanes=self.lanes)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


class GroupInt8LinearMethod(GgufLinearMethod):
    """`--weight-quant int8`: every linear weight re-quantized to int8 with one scale per group of
    32 columns, stored as GGUF Q8_0 blocks (llama.cpp's own int8 format: an fp16 scale
    max|w| / 127 per 32 weights, 1.06 bytes a weight, quantized by the gguf package's reference
    quantizer) and run on the Q8_0 block kernel, at every T on VNNI builds (then only the blocks
    are kept), elsewhere for small batches with an fp32 GEMM on the dequantized values above
    (layer.weight is replaced by them: both paths compute one model).
    A group of 32 tracks the weights' local range far better than one scale per row (the old
    per-row int8: SmolLM2 top-1 agreement 0.879 with Hugging Face), at the memory of a per-64
    fp32-scale scheme. Layers whose K is not a multiple of 32 keep float weights."""

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
