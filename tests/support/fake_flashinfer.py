"""A stand-in for the `flashinfer` package on the CPU: the two paged wrappers the CUDA backend
uses, with FlashInfer's constructor and plan() signatures (0.2 - 0.7: positional problem shape,
keyword dtypes / sm_scale / causal) and its documented semantics, computed by the plain-torch
reference. It lets the CPU suite drive FlashInferAttention, the executor's CUDA-graph path
(graph capture replaced by eager replay) and device sampling end to end. It checks what the real
library would reject (dtypes, shapes, fixed batch size in graph mode, CPU-side indptr) but it is
not FlashInfer: the kernels themselves are only tested on a GPU (tests/gpu/test_backend.py)."""
from __future__ import annotations

import torch

from tests.support.flashinfer_reference import reference_attention
from worker_svc.backends.cuda.flashinfer_meta import PagedBatch

__version__ = "fake"


class _Wrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False):
        assert kv_layout == "NHD", kv_layout
        self.use_cuda_graph = use_cuda_graph
        self.plan_args = None
        self.runs = 0

    def _plan(self, qo_indptr, kv_indptr, kv_indices, last, num_qo_heads, num_kv_heads, head_dim,
              page_size, causal, q_data_type, kv_data_type, sm_scale):
        for t in (qo_indptr, kv_indptr, kv_indices, last):
            assert t.dtype == torch.int32, t.dtype
        assert kv_indptr.device.type == "cpu" and last.shape[0] + 1 == kv_indptr.shape[0]
        self.plan_args = dict(pb=PagedBatch(qo_indptr.clone(), kv_indptr.clone(), kv_indices.clone(),
                                            last.clone(), torch.empty(0), page_size, False),
                              heads=(num_qo_heads, num_kv_heads, head_dim), causal=causal,
                              q_dtype=q_data_type, kv_dtype=kv_data_type,
                              scale=sm_scale if sm_scale is not None else head_dim ** -0.5)

    def run(self, q, paged_kv_cache, out=None):
        a = self.plan_args
        assert a is not None, "run() before plan()"
        k, v = paged_kv_cache
        hq, hkv, dim = a["heads"]
        assert q.shape[1:] == (hq, dim) and k.shape[2:] == (hkv, dim) and k.shape == v.shape
        assert q.shape[0] == int(a["pb"].qo_indptr[-1]), "rows differ from the plan"
        assert q.dtype == a["q_dtype"] and k.dtype == a["kv_dtype"]
        assert a["causal"], "paged prefill without causal=True would let chunks see the future"
        self.runs += 1
        result = reference_attention(q, k, v, a["pb"], a["scale"])
        if out is None:
            return result
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        out.copy_(result)
        return out


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None, **kw):
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                   num_kv_heads, head_dim_qk, page_size, causal, q_data_type, kv_data_type, sm_scale)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto", jit_args=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)
        if use_cuda_graph:
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None, **kw):
        batch = last_page_len.shape[0]
        if self.use_cuda_graph:      # the real wrapper: fixed batch size, copies into the buffers
            ind_buf, idx_buf, last_buf = self.buffers
            assert batch == last_buf.shape[0], f"batch {batch} != graph size {last_buf.shape[0]}"
            assert indices.shape[0] <= idx_buf.shape[0], "page indices overflow the graph buffer"
        qo = torch.arange(batch + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                   True, q_data_type, kv_data_type, sm_scale)


# -- the fused elementwise kernels (worker_svc/backends/cuda/ops.py), as documented: fp32 inside,
# one rounding at the end; the real library's shape / dtype / layout checks
def _check_rows(x, weight):
    if x.shape[0] == 0:     # the real kernels fail a zero-sized launch ("invalid argument")
        raise RuntimeError("RMSNorm failed with error code invalid argument")
    assert x.dim() == 2 and x.is_contiguous() and weight.shape == x.shape[1:], (x.shape, weight.shape)
    assert x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype


def _norm(h, weight, eps):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    _check_rows(input, weight)
    y = _norm(input.float(), weight, eps).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """residual += input; input = rmsnorm(residual): both in place, returns None."""
    _check_rows(input, weight)
    assert residual.shape == input.shape and residual.dtype == input.dtype and residual.is_contiguous()
    r = input.float() + residual.float()
    residual.copy_(r)
    input.copy_(_norm(r, weight, eps))


def silu_and_mul(input, out=None, enable_pdl=None):
    if input.shape[0] == 0:
        raise RuntimeError("act_and_mul failed with error code invalid argument")
    if input.shape[-1] * input.dtype.itemsize % 16 != 0:
        raise ValueError("The pointers must be multiple of 16 bytes.")
    gate, up = input.float().chunk(2, dim=-1)
    y = (torch.nn.functional.silu(gate) * up).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    assert is_neox, "the model's heads are rotate_half (NeoX) style"
    assert positions.dtype in (torch.int32, torch.int64) and positions.is_contiguous()
    if positions.shape[0] == 0:
        raise RuntimeError("BatchQKApplyRotaryPosIdsCosSinCache failed with error code invalid argument")
    q = query.view(query.shape[0], -1, head_size)     # what the real wrapper does: views or fails
    k = key.view(key.shape[0], -1, head_size)
    assert q.stride(-1) == 1 and k.stride(-1) == 1
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for t in (q, k):
        x1, x2 = t[..., :half].float(), t[..., half:2 * half].float()
        t[..., :half], t[..., half:2 * half] = (x1 * cos - x2 * sin).to(t.dtype), (x2 * cos + x1 * sin).to(t.dtype)
