"""The CUDA backend: FlashInfer paged attention, cuBLAS matmuls, CUDA graphs, device sampling.

Attention ("auto", the default): FlashInfer (`pip install .[gpu]`, package flashinfer-python)
when it imports; else the torch path (worker_svc.attention, SDPA on the GPU) with the reason
logged and printed in describe(), and no CUDA graphs (the torch path's decode grouping has
data-dependent shapes). attention="flashinfer" makes a missing FlashInfer an error instead;
attention="torch" picks the torch path on purpose (the reference the GPU tests compare with).

FlashInfer is imported here, lazily, only when a CUDA backend is built: the CPU install and
the CPU test suite never import it (tests/test_gpu_optional.py).

Per batch: worker_svc.flashinfer_meta builds qo/kv indptr, page indices, last-page lengths and
the slot mapping on the host from the block tables, and one wrapper's plan() runs (the decode
wrapper, tensor-core kernels, for decode-only batches; the paged prefill wrapper, causal, for
hybrid batches with chunks and decodes together). Per layer: the batch's K/V go to their slots
(index_copy_ on the device), then the wrapper's run() reads the cache in place. The cache is
PagedKVCache's [num_blocks, block_size, Hkv, D] k and v per layer, passed as a tuple: FlashInfer's
NHD paged layout.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from worker_svc.attention import TorchAttention
from worker_svc.backends.base import DeviceBackend, LinearMethod
from worker_svc.flashinfer_meta import PagedBatch, build_paged_batch

log = logging.getLogger("sarathi.worker")

WORKSPACE_BYTES = 256 * 1024 * 1024     # FlashInfer's split-k scratch (it recommends 128 MB)


@dataclass
class FlashInferMetadata:
    """One batch's attention state: slot_mapping [T] int64 on the device, and the wrapper whose
    plan() describes this batch (every layer calls its run())."""

    slot_mapping: torch.Tensor
    wrapper: Any


class FlashInferAttention:
    """The AttentionBackend on FlashInfer's paged kernels (see module docstring).

    bind() must be called once with the model's attention shapes before the first batch (the
    executor does, through DeviceBackend.bind)."""

    name = "flashinfer"
    workspace_bytes = WORKSPACE_BYTES

    def __init__(self, device: torch.device, kv_cache_dtype: torch.dtype):
        import flashinfer   # the optional [gpu] extra; only ever imported on a CUDA worker

        self.flashinfer = flashinfer
        self.device = device
        self.kv_cache_dtype = kv_cache_dtype
        self.workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                    use_tensor_cores=True)
        self.shapes: dict[str, Any] | None = None
        self._graph_indices: torch.Tensor | None = None

    def bind(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, q_dtype: torch.dtype,
             scale: float, max_pages: int) -> None:
        """The model's per-rank attention shapes; max_pages bounds the pages of one batch
        (max_num_seqs x blocks per sequence) for the graphs' fixed index buffer."""
        self.shapes = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           q_dtype=q_dtype, scale=scale, max_pages=max_pages)

    def decode_wrapper(self, batch_size: int):
        """A decode wrapper fixed to batch_size sequences for a CUDA graph: plan() writes into
        its own indptr / last-page buffers and the shared page-index buffer, which the captured
        kernels read. Graphs replay one at a time, so sharing the index buffer is safe."""
        if self._graph_indices is None:
            self._graph_indices = torch.zeros(self.shapes["max_pages"], dtype=torch.int32, device=self.device)
        return self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=self._graph_indices,
            paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32, device=self.device))

    def plan(self, wrapper, pb: PagedBatch) -> None:
        """Once per batch: the host-side schedule of `wrapper` for the batch pb (CPU tensors)."""
        s = self.shapes
        if s is None:
            raise RuntimeError("FlashInferAttention.bind() was not called before the first batch")
        common = dict(q_data_type=s["q_dtype"], kv_data_type=self.kv_cache_dtype, sm_scale=s["scale"])
        if wrapper is self.prefill:
            wrapper.plan(pb.qo_indptr, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len,
                         s["num_qo_heads"], s["num_kv_heads"], s["head_dim"], pb.page_size,
                         causal=True, **common)
        else:
            wrapper.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len,
                         s["num_qo_heads"], s["num_kv_heads"], s["head_dim"], pb.page_size, **common)

    def metadata(self, wrapper, slot_mapping: torch.Tensor) -> FlashInferMetadata:
        return FlashInferMetadata(slot_mapping, wrapper)

    def build_metadata(self, seqs: list[tuple[int, int, list[int]]], block_size: int,
                       device: torch.device | str) -> FlashInferMetadata:
        return self.build_from(build_paged_batch(seqs, block_size), device)

    def build_from(self, pb: PagedBatch, device: torch.device | str) -> FlashInferMetadata:
        wrapper = self.decode if pb.decode_only else self.prefill
        self.plan(wrapper, pb)
        return self.metadata(wrapper, pb.slot_mapping.to(device, non_blocking=True))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, layer: int,
                meta: FlashInferMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of this step's tokens (rotated) -> out [T, Hq, D].
        The softmax scale was fixed at plan time (bind(scale)); `scale` is the same number."""
        cache.write(layer, meta.slot_mapping, k, v)
        return meta.wrapper.run(q, (cache.k[layer], cache.v[layer]))


def flashinfer_unavailable_reason() -> str | None:
    """None when flashinfer imports; else why not (one line)."""
    try:
        import flashinfer  # noqa: F401
    except Exception as e:   # ImportError, or a broken install failing at import
        return f"flashinfer not importable ({type(e).__name__}: {e}); install it with pip install '.[gpu]'"
    return None


def cuda_backend(device: torch.device, compute_dtype: torch.dtype,
                 kv_cache_dtype: torch.dtype | None = None, attention: str = "auto") -> DeviceBackend:
    """attention: "auto" (FlashInfer, else torch with a logged reason), "flashinfer", "torch"."""
    if not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but torch sees no CUDA device "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
    if attention not in ("auto", "flashinfer", "torch"):
        raise ValueError(f"unknown CUDA attention {attention!r}; choose auto, flashinfer or torch")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kv = kv_cache_dtype or compute_dtype
    reason = None if attention == "torch" else flashinfer_unavailable_reason()
    if attention == "flashinfer" and reason:
        raise ValueError(f"attention 'flashinfer' requested but {reason}")
    if attention == "torch" or reason:
        if reason:
            log.warning("CUDA worker falls back to the torch attention path, no CUDA graphs: %s", reason)
        return DeviceBackend(device, TorchAttention(), LinearMethod(), kv, sample_on_device=True,
                             note=f"fallback: {reason}" if reason else "")
    return DeviceBackend(device, FlashInferAttention(device, kv), LinearMethod(), kv,
                         sample_on_device=True, scratch_blocks=1, make_graph_runner=_graph_runner)


def _graph_runner(model, cache, attention, sizes, scratch_block, device):
    from worker_svc.cuda_graphs import CudaGraphRunner

    return CudaGraphRunner(model, cache, attention, sizes, scratch_block, device)
