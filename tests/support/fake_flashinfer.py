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

    def run(self, q, paged_kv_cache):
        a = self.plan_args
        assert a is not None, "run() before plan()"
        k, v = paged_kv_cache
        hq, hkv, dim = a["heads"]
        assert q.shape[1:] == (hq, dim) and k.shape[2:] == (hkv, dim) and k.shape == v.shape
        assert q.shape[0] == int(a["pb"].qo_indptr[-1]), "rows differ from the plan"
        assert q.dtype == a["q_dtype"] and k.dtype == a["kv_dtype"]
        assert a["causal"], "paged prefill without causal=True would let chunks see the future"
        self.runs += 1
        return reference_attention(q, k, v, a["pb"], a["scale"])


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
