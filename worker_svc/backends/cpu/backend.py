"""The CPU backend: torch matmuls (or linear layers on quantized weights for small batches);
decode attention on the native kernel where it is built with SIMD; a 16-bit KV cache.

With the native attention chosen, decodes run the native paged kernel (csrc/paged_decode.c:
reads each KV block in place, once) and chunks (more than one query) the native chunk kernel
(csrc/chunk_attention.c: compute-bound, register-blocked like a GEMM); each where it accepts the
shapes/dtypes, otherwise the torch path (worker_svc.backends.torch_attention: grouped SDPA for
decodes, one SDPA call a chunk). SARATHI_NATIVE_CHUNK=0 keeps chunks on SDPA (A/B measurements).

The three choices, each made once per worker and printed by the executor:
* attention "auto": native when the kernel's SIMD path is in NATIVE_FASTER, the paths measured
  faster than the torch path (bench/attention_kernel.py); the scalar fallback is slower than
  torch, so it never runs by default;
* KV cache dtype "auto" (None): 16-bit, AUTO_KV_DTYPE. Decode attention is bound by reading the
  cache, so half the bytes is up to 2x. bf16 rather than fp16: the kernel widens either at about
  the same cost, the torch fallback path casts bf16 faster, and bf16 keeps fp32's exponent range
  (fp16 overflows at 65504); fp16's 3 extra mantissa bits remain available as
  --kv-cache-dtype float16;
* weight quantization "auto": the model as its files define it. A GGUF's quantized matrices run
  on the file's own blocks (cpu/gguf.py, csrc/gguf_*.c: integer dots with each token's
  activations quantized to ~15 bits, "int8x2"; SARATHI_GGUF_DOT=int8 / fp32 pick llama.cpp's
  8-bit activations or the exact fp32-dot kernel), and where the build has a token threshold a
  float GEMM on their exact dequantization above it; a float checkpoint stays float. "none":
  float weights everywhere (a GGUF exactly dequantized). Explicit, lossy choices: "int8",
  re-quantized to int8 with a scale per 32 columns (Q8_0 blocks on the same kernels: cpu/gguf.py
  GroupInt8LinearMethod); "int8-bf16", per-row int8 for small batches and a bf16 GEMM above
  (cpu/quant.py).

Besides: the layers' elementwise glue (RMSNorm + residual add, rotary, silu * up) runs fused
native ops (NativeCpuOps, csrc/cpu_ops.c) when the library has their AVX2 path, and the native
attention writes each layer's K/V to the paged cache in one native call. SARATHI_NATIVE_OPS=0
keeps both on the torch reference (worker_svc/backends/base.py Ops; for A/B measurements). With
both, a GGUF model's decode steps run through every layer in one native call (cpu/stack.py,
CpuBackend.layer_stack).

What the executor asks of a backend (CpuBackend): compute dtype "auto" is float32, the KV cache
holds DEFAULT_CPU_BLOCKS blocks when none were given, tokens are drawn by the host sampler, no
graphs, and ranks talk over gloo.

Measurements behind these choices: bench/results/kernels/README.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from shared.config import DEFAULT_CPU_BLOCKS
from worker_svc.backends.base import DeviceBackend, LinearMethod, Ops, SeqSpec
from worker_svc.backends.cpu import native
from worker_svc.backends.cpu.stack import decode_stack
from worker_svc.backends.torch_attention import AttentionMetadata, TorchAttention, build_metadata, pad_tables

# the native decode kernel's SIMD paths measured faster than the torch decode path
# (bench/attention_kernel.py); its scalar path is slower than torch
NATIVE_FASTER = ("avx512", "avx2")
AUTO_KV_DTYPE = torch.bfloat16


@dataclass
class CpuBackend(DeviceBackend):
    """The CPU's answers to the executor's questions (see DeviceBackend)."""

    # float32 for dtype "auto": without AMX, torch's bf16 matmuls run slower than its fp32 ones,
    # so prefill chunks and hybrid batches are slower in bf16 and single decodes no faster; bf16
    # wins only on long-context decode-only batches (half the KV bytes to read)
    default_dtype: ClassVar[torch.dtype] = torch.float32
    dist_backend: ClassVar[str] = "gloo"

    def num_kv_blocks(self, model, cfg, num_kv_heads, block_size, config, distributed) -> int:
        """DEFAULT_CPU_BLOCKS: host memory is not profiled."""
        return DEFAULT_CPU_BLOCKS

    def layer_stack(self, layers):
        """Decode-only steps through all layers in one native call, where the layers run on
        the native kernels (cpu/stack.py); None otherwise."""
        return decode_stack(layers, self.linear, self.compute_dtype, native_ops=isinstance(self.ops, NativeCpuOps),
                            native_kv_write=isinstance(self.attention, NativeCpuAttention)
                            and self.attention.fused_write)


@dataclass
class NativeDecode:
    """All decodes of a batch in the native kernel's form, in batch row order (CPU int32
    tensors): rows [B] batch rows, tables [B, nb] block ids padded with 0 (the kernel reads only
    the first ceil(lens[b] / bs)), lens [B] context lengths including the new token."""

    rows: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor


@dataclass
class NativeCpuMetadata(AttentionMetadata):
    """AttentionMetadata plus the batch's decodes for the native kernel (None: no decodes)."""

    native_decode: NativeDecode | None = None
    chunk_tables: list[torch.Tensor] | None = None   # the chunks' block tables, int32 (native chunks)


class NativeCpuAttention(TorchAttention):
    """TorchAttention with the decodes of a batch in one native kernel call per layer, and (when
    fused_write) the layer's K/V written to the cache by one native call (native.write_kv: the
    cast and both index copies of PagedKVCache.write, same values)."""

    def __init__(self, fused_write: bool = False):
        self.name = f"native {native.isa()}"
        self.fused_write = fused_write
        self.native_chunks = os.environ.get("SARATHI_NATIVE_CHUNK", "1") != "0"
        if not self.native_chunks:
            self.name += " (chunks on torch SDPA)"
        self._write_ok: dict[tuple, bool] = {}     # (k dtype, cache dtype) -> write_kv casts it

    def build_metadata(self, seqs: list[SeqSpec], block_size: int,
                       device: torch.device | str = "cpu") -> NativeCpuMetadata:
        """The torch path's metadata (its fallback) with the decodes as the kernel reads them."""
        meta = build_metadata(seqs, block_size, NativeCpuMetadata)
        d = meta.decode_seqs
        if d.rows:
            meta.native_decode = NativeDecode(torch.tensor(d.rows, dtype=torch.int32),
                                              pad_tables(d.tables, torch.int32),
                                              torch.tensor(d.lens, dtype=torch.int32))
        if meta.chunks and self.native_chunks:
            meta.chunk_tables = [c.blocks.to(torch.int32) for c in meta.chunks]
        return meta.to(device)

    def _write(self, cache, layer, meta, k, v) -> None:
        """PagedKVCache.write in one native call when the dtypes and layouts allow."""
        kc, vc = cache.k[layer], cache.v[layer]
        key = (k.dtype, kc.dtype)
        ok = self._write_ok.get(key)
        if ok is None:
            ok = self._write_ok[key] = self.fused_write and native.write_kv_supports(*key)
        # k, v are views of the qkv output: heads contiguous ([T, Hkv, D] with stride(1) == D)
        if ok and k.stride(2) == 1 and v.stride(2) == 1 and k.stride(1) == v.stride(1) == k.shape[2] \
                and k.shape == v.shape and kc.shape[2:] == k.shape[1:]:
            native.write_kv(k, v, kc, vc, meta.slot_mapping, check=False)
        else:
            cache.write(layer, meta.slot_mapping, k, v)

    def _decodes(self, q, kc, vc, meta, out, scale) -> None:
        nd = meta.native_decode
        # out is empty_like(q): what supports() accepts for q holds for out
        if nd is not None and native.supports(q, kc):
            native.paged_decode_attention(q, kc, vc, nd.tables, nd.lens, scale, out, rows=nd.rows)
        else:
            super()._decodes(q, kc, vc, meta, out, scale)

    def _chunk(self, q, kc, vc, meta, i, out, scale) -> None:
        """The native chunk kernel where it takes the layout (else the torch path): the same
        guard as the decodes' (out is empty_like(q)), the cache's V like its K by construction."""
        c = meta.chunks[i]
        if meta.chunk_tables is None or not native.supports(q, kc) or not native.chunk_attention(
                q[c.row_start:c.row_end], kc, vc, meta.chunk_tables[i], c.start_pos, scale,
                out[c.row_start:c.row_end], check=False):
            super()._chunk(q, kc, vc, meta, i, out, scale)


class NativeCpuOps(Ops):
    """Ops on the fused native kernels (csrc/cpu_ops.c) for fp32/bf16 tensors laid out as the
    model makes them (rows of contiguous elements); anything else takes the torch reference.
    Differs from Ops only in place: add_rms_norm stores r into residual, rotary rotates q and k
    in place (both allowed by Ops' contract)."""

    def __init__(self):
        self.name = f"native {native.ops_isa()}"

    # The guards below check what the kernels need (dtype, element layout, matching sizes) in
    # the fewest tensor attribute reads, then call them with check=False: native's full checks
    # would cost about as much as the kernel at decode sizes. Tensors are CPU tensors on a CPU
    # backend.

    def rms_norm(self, x, weight, eps):
        if x.dtype in _NATIVE_OPS_DTYPES and x.dim() == 2 and x.stride(1) == 1 \
                and weight.dtype == x.dtype and weight.shape == x.shape[1:] and weight.stride(0) == 1:
            return native.rms_norm(x, weight, eps, check=False)[0]
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if x.dtype in _NATIVE_OPS_DTYPES and x.dim() == 2 and x.stride(1) == 1 \
                and residual.dtype == x.dtype and residual.shape == x.shape and residual.stride(1) == 1 \
                and weight.dtype == x.dtype and weight.shape == x.shape[1:] and weight.stride(0) == 1:
            return native.rms_norm(x, weight, eps, residual, check=False)
        return super().add_rms_norm(x, residual, weight, eps)

    def rotary(self, q, k, cos_sin):
        cos, sin = cos_sin
        D = q.shape[-1]
        if q.dtype in _NATIVE_OPS_DTYPES and k.dtype == q.dtype and cos.dtype == q.dtype \
                and sin.dtype == q.dtype and q.dim() == 3 and k.dim() == 3 and D % 2 == 0 \
                and q.stride(2) == 1 and q.stride(1) == D and k.stride(2) == 1 and k.stride(1) == D \
                and k.shape[0] == q.shape[0] and k.shape[2] == D \
                and cos.shape == sin.shape == (q.shape[0], 1, D) and cos.is_contiguous() and sin.is_contiguous():
            native.rotary_(q, k, cos, sin, check=False)
            return q, k
        return super().rotary(q, k, cos_sin)

    def silu_mul(self, gate_up):
        if gate_up.dtype in _NATIVE_OPS_DTYPES and gate_up.dim() == 2 and gate_up.stride(1) == 1 \
                and gate_up.shape[1] % 2 == 0:
            return native.silu_mul(gate_up, check=False)
        return super().silu_mul(gate_up)


_NATIVE_OPS_DTYPES = (torch.float32, torch.bfloat16)


def native_ops_enabled() -> bool:
    """Fused native ops and KV write: the library loads, its ops have the AVX2 path (the scalar
    exp of silu would lose to torch), and SARATHI_NATIVE_OPS is not "0"."""
    return (os.environ.get("SARATHI_NATIVE_OPS", "1") != "0" and native.available()
            and native.ops_isa() == "avx2")


def cpu_backend(compute_dtype: torch.dtype | None = None, kv_cache_dtype: torch.dtype | None = None,
                attention: str = "auto", weight_quant: str = "auto") -> CpuBackend:
    """compute_dtype: None = CpuBackend.default_dtype. attention: "auto" (native when built and
    measured faster here, else torch), "native" or "torch". kv_cache_dtype: None = AUTO_KV_DTYPE
    (the compute dtype when that is 16-bit).
    weight_quant: "auto" (GGUF blocks on their kernels when built with SIMD here, else float), "none", "int8", or
    "int8-bf16" (int8 for small batches, bf16 GEMM above: faster prefill on CPUs with bf16 dot
    products, but a request's output then depends on which batch carried it; see quant.py)."""
    if attention not in ("auto", "native", "torch"):
        raise ValueError(f"unknown CPU attention {attention!r}; choose auto, native or torch")
    if attention == "native" and not native.available():
        raise ValueError(f"attention 'native' requested but {native.unavailable_reason()}")
    if weight_quant not in ("auto", "none", "int8", "int8-bf16"):
        raise ValueError(f"unknown weight quantization {weight_quant!r}; choose auto, none, int8 or int8-bf16")
    if compute_dtype is None:
        compute_dtype = CpuBackend.default_dtype
    use_native = attention == "native" or (attention == "auto" and native.available()
                                           and native.isa() in NATIVE_FASTER)
    if kv_cache_dtype is None:
        kv_cache_dtype = compute_dtype if compute_dtype.itemsize == 2 else AUTO_KV_DTYPE
    linear = LinearMethod()
    if weight_quant == "int8":
        # int8 with a scale per 32 columns (Q8_0 blocks): near-lossless, batch-invariant
        from worker_svc.backends.cpu.gguf import GroupInt8LinearMethod
        linear = GroupInt8LinearMethod()
    elif weight_quant == "int8-bf16":
        from worker_svc.backends.cpu.quant import Int8LinearMethod
        linear = Int8LinearMethod(large=torch.bfloat16)
    elif weight_quant == "auto" and native.available() and native.gguf_isa() != "scalar":
        # the model as its files define it: GGUF blocks on their own kernels, float weights as is
        from worker_svc.backends.cpu.gguf import GgufLinearMethod
        linear = GgufLinearMethod()
    fused = native_ops_enabled()
    note = native.build_note() if native.available() else f"no native kernels: {native.unavailable_reason()}"
    return CpuBackend(torch.device("cpu"),
                      NativeCpuAttention(fused_write=fused) if use_native else TorchAttention(),
                      linear, kv_cache_dtype, compute_dtype, ops=NativeCpuOps() if fused else Ops(),
                      note=note)
