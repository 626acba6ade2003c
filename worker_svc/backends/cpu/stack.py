"""The CPU backend's layer stack: a decode-only step through every decoder layer in one native
call (csrc/decode_stack.c), instead of ten Python-driven native calls a layer.

At decode sizes the per-layer path's Python side (module dispatch, argument marshalling, a new
tensor per op) costs about as much as its kernels. The native loop calls the same kernels with
the same arguments, so its output is bit-identical to the per-layer path's (tests/worker/
test_decode_stack.py). It is the CPU's answer to DeviceBackend.layer_stack, as CUDA graphs are
the GPU's answer to the same per-op cost.

It runs a step when (checked per call, else the model runs its layers as before):
* every query of the batch is a decode on the native attention kernel (no prefill chunk);
* T <= the linear method's max_tokens (the block kernel's range);
* x is fp32 and the cache's dtype is one the KV write and the attention kernel take.
It is built (decode_stack returns one) only for a single-rank model whose every linear layer runs
on GGUF blocks with the integer-dot kernel (GgufLinearMethod with dot int8 or int8x2, or
GroupInt8LinearMethod), on a backend with the fused native ops and the native attention writing
K/V itself, fp32 compute. SARATHI_NATIVE_STACK=0 turns it off (A/B measurements).

The backend (cpu/backend.py) builds the stack and tells decode_stack what it runs: this module
does not import the backend.
"""
from __future__ import annotations

import os

import torch

from worker_svc.backends.base import LinearMethod
from worker_svc.backends.cpu import native
from worker_svc.backends.cpu.gguf import DOT_PARTS, GgufLinearMethod


class NativeDecodeStack:
    """Callable (x, cos_sin, cache, meta) -> (mlp output, residual) or None (not this batch);
    see the module docstring. Holds the layers' weight pointers (int64 table, rebuilt when the
    cache's tensors change); the layers must outlive it."""

    name = "native decode stack"

    def __init__(self, layers, parts: int, max_tokens: int, lanes: bool = False):
        self.layers = list(layers)
        first = self.layers[0]
        self.parts = parts
        self.max_tokens = max_tokens
        self.lanes = lanes   # the linear method's (gguf.py default_lanes)
        self.heads = (first.num_heads, first.num_kv_heads, first.head_dim)
        self.intermediate = first.gate_up.gguf_data.shape[0] // 2
        self.eps = float(first.input_norm.eps)
        self.scale = float(first.scale)
        # the O projections' biases as the kernel reads them (fp32, contiguous; None: no bias)
        self._o_bias = [None if layer.o_proj.bias is None else layer.o_proj.bias.detach().float().contiguous()
                        for layer in self.layers]
        self._fields: torch.Tensor | None = None
        self._key: tuple | None = None
        self._ok: dict[torch.dtype, bool] = {}

    @staticmethod
    def eligible(layers) -> bool:
        """Whether every layer has what cpu_decode_stack reads (see the module docstring)."""
        if not layers:
            return False
        for layer in layers:
            lins = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
            if any(getattr(m, "gguf_data", None) is None for m in lins):
                return False
            if layer.o_proj.tp.world_size != 1 or layer.gate_up.gguf_data.shape[0] % 2:
                return False
            for norm in (layer.input_norm, layer.post_norm):
                if norm.weight.dtype != torch.float32 or not norm.weight.is_contiguous() \
                        or norm.eps != layer.input_norm.eps:
                    return False
            if layer.head_dim > native.MAX_D or layer.num_heads % layer.num_kv_heads \
                    or layer.num_heads // layer.num_kv_heads > native.MAX_G:
                return False
        return True

    def _table(self, cache) -> torch.Tensor:
        key = (cache.k[self.layers[0].index].data_ptr(), len(cache.k))
        if self._key != key:
            rows = []
            for layer, o_bias in zip(self.layers, self._o_bias):
                lins = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
                qkv_bias = getattr(layer.qkv, "bias_f32", None)
                rows.append([m.gguf_data.data_ptr() for m in lins] + [m.gguf_data.shape[1] for m in lins]
                            + [int(m.gguf_type) for m in lins]
                            + [0 if qkv_bias is None else qkv_bias.data_ptr(),
                               0 if o_bias is None else o_bias.data_ptr(),
                               layer.input_norm.weight.data_ptr(), layer.post_norm.weight.data_ptr(),
                               cache.k[layer.index].data_ptr(), cache.v[layer.index].data_ptr()])
            self._fields = torch.tensor(rows, dtype=torch.int64)
            assert self._fields.shape[1] == native.decode_stack_fields()
            self._key = key
        return self._fields

    def _cache_ok(self, cache) -> bool:
        kc = cache.k[self.layers[0].index]
        ok = self._ok.get(kc.dtype)
        if ok is None:
            ok = self._ok[kc.dtype] = native.write_kv_supports(torch.float32, kc.dtype) and kc.is_contiguous()
        return ok

    def __call__(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], cache, meta):
        nd = getattr(meta, "native_decode", None)
        T = x.shape[0]
        if nd is None or meta.chunks or T > self.max_tokens or nd.rows.shape[0] != T \
                or x.dtype != torch.float32 or not x.is_contiguous() or not self._cache_ok(cache):
            return None
        cos, sin = cos_sin
        if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        fields = self._table(cache)
        residual = torch.empty_like(x)
        native.decode_stack(fields, x, residual, cos, sin, meta.slot_mapping,
                            cache.k[self.layers[0].index].dtype, cache.num_slots, cache.block_size,
                            nd.tables, nd.lens, nd.rows,
                            self.heads, self.intermediate, self.eps, self.scale, self.parts,
                            lanes=self.lanes)
        return x, residual


def decode_stack(layers, linear: LinearMethod, compute_dtype: torch.dtype, native_ops: bool,
                 native_kv_write: bool) -> NativeDecodeStack | None:
    """The stack for these layers, or None (see the module docstring), on a CPU backend with this
    linear method and compute dtype; native_ops: its elementwise ops run the fused native kernels
    (NativeCpuOps); native_kv_write: its attention is the native one and writes K/V itself
    (NativeCpuAttention with fused_write)."""
    if (os.environ.get("SARATHI_NATIVE_STACK", "1") == "0" or not native.available()
            or not native_ops or not native_kv_write or not isinstance(linear, GgufLinearMethod)
            or linear.dot not in DOT_PARTS or linear.max_tokens < 1 or compute_dtype != torch.float32
            or not NativeDecodeStack.eligible(layers)):
        return None
    return NativeDecodeStack(layers, DOT_PARTS[linear.dot], linear.max_tokens, linear.lanes)
