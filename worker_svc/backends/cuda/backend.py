"""The CUDA backend: FlashInfer paged attention, cuBLAS matmuls, CUDA graphs, device sampling.

Attention ("auto", the default): FlashInfer (`pip install .[gpu]`, package flashinfer-python)
when it imports; else the torch path (backends/torch_attention.py, SDPA on the GPU) with the reason
logged and printed in describe(), and no CUDA graphs (the torch path's decode grouping has
data-dependent shapes). attention="flashinfer" makes a missing FlashInfer an error instead;
attention="torch" picks the torch path on purpose (the reference the GPU tests compare with).

FlashInfer is imported here, lazily, only when a CUDA backend is built: the CPU install and
the CPU test suite never import it (tests/gpu/test_optional.py).

The layers' elementwise glue (RMSNorm with the residual add, rotary, silu * up) runs on
FlashInfer's fused kernels by default (ops.py: FlashInferOps); SARATHI_CUDA_OPS=torch puts it on
the torch reference, which rounds as Hugging Face does (see cuda_backend).

Per batch: flashinfer_meta.py builds qo/kv indptr, page indices, last-page lengths and
the slot mapping on the host from the block tables, and one wrapper's plan() runs (the decode
wrapper, tensor-core kernels, for decode-only batches; the paged prefill wrapper, causal, for
hybrid batches with chunks and decodes together). Per layer: the batch's K/V go to their slots
(index_copy_ on the device), then the wrapper's run() reads the cache in place. The cache is
PagedKVCache's [num_blocks, block_size, Hkv, D] k and v per layer, passed as a tuple: FlashInfer's
NHD paged layout.

What the model runner asks of a backend (CudaBackend): compute dtype "auto" is bfloat16, the KV
cache is sized from device memory after a profiling pass when no block count was given
(kv_sizing.py), tokens are drawn on the device where the request's parameters allow
(worker_svc.sampling.DeviceFirstSampler), decode-only batches replay CUDA graphs (cuda_graphs.py;
FlashInfer only), and ranks talk over NCCL.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from worker_svc.backends.base import DeviceBackend, LinearMethod, Ops, Readback
from worker_svc.backends.cuda import kv_sizing
from worker_svc.backends.cuda.cuda_graphs import CudaGraphRunner, capture_sizes
from worker_svc.backends.cuda.flashinfer_meta import PagedBatch, build_paged_batch
from worker_svc.backends.cuda.ops import FlashInferOps
from worker_svc.backends.torch_attention import TorchAttention
from worker_svc.sampling import DeviceFirstSampler

log = logging.getLogger("sarathi.worker")

WORKSPACE_BYTES = 256 * 1024 * 1024     # FlashInfer's split-k scratch (it recommends 128 MB)


@dataclass
class FlashInferMetadata:
    """One batch's attention state: slot_mapping [T] int64 on the device, and the wrapper whose
    plan() describes this batch (every layer calls its run()). A hybrid batch whose rows start
    with its decodes is split: decodes = that count, `wrapper` (the decode wrapper) planned for
    those rows and `prefill` (the paged prefill wrapper) for the rest."""

    slot_mapping: torch.Tensor
    wrapper: Any
    decodes: int = 0
    prefill: Any = None


class FlashInferAttention:
    """The AttentionBackend on FlashInfer's paged kernels (see module docstring).

    bind() must be called once with the model's attention shapes before the first batch (the
    model runner does, through DeviceBackend.bind)."""

    name = "flashinfer"
    workspace_bytes = WORKSPACE_BYTES

    def __init__(self, device: torch.device, kv_cache_dtype: torch.dtype):
        import flashinfer  # the optional [gpu] extra; only ever imported on a CUDA worker

        self.flashinfer = flashinfer
        self.device = device
        self.kv_cache_dtype = kv_cache_dtype
        self.workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                    use_tensor_cores=True)
        self.shapes: dict[str, Any] | None = None
        self._graph_indices: torch.Tensor | None = None
        self._cuda = torch.device(device).type == "cuda"    # False: the CPU harness (tests)
        # CUDA: id(wrapper) -> an event after that wrapper's last plan()'s copies
        self._planned: dict[int, Any] = {}

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
        """Once per batch: the host-side schedule of `wrapper` for the batch pb (CPU tensors).

        Nothing here waits for the work queued on the GPU, so batch n + 1 can be planned while
        batch n runs (async scheduling): the index arrays go from pinned memory with
        non-blocking copies (the page list to the device first: a graph wrapper copies a host
        page list with a blocking copy), and a plan starts only once the same wrapper's previous
        plan has copied its schedule out of the wrapper's own pinned buffer (that copy is queued
        before the batch's kernels, so this wait is short). The wait is per wrapper: a hybrid
        batch plans two, and a single event would make its second plan wait behind the first
        one's event, which is queued after the whole batch in flight."""
        s = self.shapes
        if s is None:
            raise RuntimeError("FlashInferAttention.bind() was not called before the first batch")
        if self._cuda:
            before = self._planned.get(id(wrapper))
            if before is not None:
                before.synchronize()
            pb = dataclasses.replace(
                pb, qo_indptr=pb.qo_indptr.pin_memory(), kv_indptr=pb.kv_indptr.pin_memory(),
                kv_last_page_len=pb.kv_last_page_len.pin_memory(),
                kv_indices=pb.kv_indices.pin_memory().to(self.device, non_blocking=True))
        self._plan(wrapper, pb, s)
        if self._cuda:
            done = self._planned[id(wrapper)] = torch.cuda.Event()
            done.record()

    def _plan(self, wrapper, pb: PagedBatch, s: dict) -> None:
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
        """Decode-only batches plan the decode wrapper. A hybrid batch that starts with decodes
        (the order Sarathi's policies build: running decodes, then prefill chunks) is split in
        two: its decodes on the decode kernel, its chunks on the paged prefill kernel. The
        prefill kernel would run each decode as a one-row query tile, reading the decode's whole
        context at a tile's cost; on a 32-decode + 512-token batch that made attention 3-4x the
        two kernels' time (bench/results/gpu/README.md). Any other order takes the prefill
        kernel for every row."""
        pb = build_paged_batch(seqs, block_size)
        slot_mapping = pb.slot_mapping.pin_memory() if self._cuda else pb.slot_mapping
        slots = slot_mapping.to(device, non_blocking=True)
        if pb.decode_only:
            self.plan(self.decode, pb)
            return self.metadata(self.decode, slots)
        decodes = next((i for i, (_, n, _) in enumerate(seqs) if n != 1), len(seqs))
        if decodes == 0:
            self.plan(self.prefill, pb)
            return self.metadata(self.prefill, slots)
        self.plan(self.decode, build_paged_batch(seqs[:decodes], block_size))
        self.plan(self.prefill, build_paged_batch(seqs[decodes:], block_size))
        return FlashInferMetadata(slots, self.decode, decodes, self.prefill)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, layer: int,
                meta: FlashInferMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of this step's tokens (rotated) -> out [T, Hq, D].
        The softmax scale was fixed at plan time (bind(scale)); `scale` is the same number.
        The two wrappers of a split batch share the workspace: they run one after the other on
        the same stream, and each plan's scratch is used within its own run."""
        cache.write(layer, meta.slot_mapping, k, v)
        kv = (cache.k[layer], cache.v[layer])
        if meta.prefill is None:
            return meta.wrapper.run(q, kv)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        d = meta.decodes
        meta.wrapper.run(q[:d], kv, out=out[:d])
        meta.prefill.run(q[d:], kv, out=out[d:])
        return out


def flashinfer_unavailable_reason() -> str | None:
    """None when flashinfer imports; else why not (one line)."""
    try:
        import flashinfer  # noqa: F401
    except Exception as e:   # ImportError, or a broken install failing at import
        return f"flashinfer not importable ({type(e).__name__}: {e}); install it with pip install '.[gpu]'"
    return None


@dataclass
class CudaBackend(DeviceBackend):
    """The CUDA device's answers to the model runner's questions (see module docstring).
    graph_runner_class: what captures CUDA graphs (CudaGraphRunner; it needs FlashInfer's
    graph-safe decode wrappers), None = no graphs (the torch fallback)."""

    graph_runner_class: type | None = None

    default_dtype: ClassVar[torch.dtype] = torch.bfloat16
    dist_backend: ClassVar[str] = "nccl"
    sample_on_device: ClassVar[bool] = True

    def num_kv_blocks(self, model, cfg, num_kv_heads, block_size, config, distributed) -> int:
        """Sized from device memory after a profiling pass at the largest batch
        (config.max_num_batched_tokens tokens; kv_sizing.py), config.gpu_memory_utilization of it."""
        if distributed:   # the profiling pass would run one stage alone
            raise ValueError("with --tp/--pp > 1 on CUDA give --num-blocks (the same on every rank)")
        tokens = max(1, config.max_num_batched_tokens)
        peak, other = kv_sizing.profile_peak_bytes(
            model, self, cfg.num_layers, num_kv_heads, cfg.head_dim, block_size,
            tokens, cfg.max_position_embeddings, self.device)
        per_block = kv_sizing.block_bytes(cfg.num_layers, block_size, num_kv_heads, cfg.head_dim,
                                          self.kv_cache_dtype)
        total = torch.cuda.get_device_properties(self.device).total_memory
        blocks = kv_sizing.blocks_that_fit(total, peak, other, config.gpu_memory_utilization, per_block)
        blocks -= self.scratch_blocks
        log.info("KV cache sized from device memory: %d blocks (%.1f GiB; profile peak %.1f GiB "
                 "at %d tokens, other use %.1f GiB, utilization %.2f)", blocks,
                 blocks * per_block / 2**30, peak / 2**30, tokens, other / 2**30,
                 config.gpu_memory_utilization)
        return max(blocks, 1)

    def sampler(self, seed: int | None, eos_token_ids: list[int] | tuple) -> DeviceFirstSampler:
        """On the device where every due request's parameters allow it, else on the host."""
        return DeviceFirstSampler(seed, eos_token_ids)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Through pinned memory, non-blocking: a copy from pageable memory may wait for the
        work queued on the stream, which would serialize batch n + 1's preparation behind batch
        n. PyTorch's pinned-memory cache keeps the staging block until the copy has run."""
        if self.device.type != "cuda":        # the CPU harness of this backend (tests)
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def read_back(self, t: torch.Tensor):
        """A non-blocking copy into pinned memory and an event after it: the returned call
        waits for this copy (and what was queued before it), not for a batch launched after."""
        if self.device.type != "cuda":
            return Readback(t.tolist)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> list:
            done.synchronize()
            return host.tolist()
        return Readback(wait, done.query, done.synchronize)

    def graph_runner(self, model, cache, max_num_seqs: int) -> CudaGraphRunner | None:
        """Graphs for decode batches of 1, 2, 4, ... up to max_num_seqs sequences (capture_sizes);
        their padding rows use the first scratch block, the first id past the scheduler's."""
        if self.graph_runner_class is None:
            return None
        return self.graph_runner_class(model, cache, self.attention, capture_sizes(max_num_seqs),
                                       cache.num_blocks - self.scratch_blocks, self.device)


def cuda_backend(device: torch.device, compute_dtype: torch.dtype | None = None,
                 kv_cache_dtype: torch.dtype | None = None, attention: str = "auto",
                 ops: str | None = None) -> CudaBackend:
    """compute_dtype: None = CudaBackend.default_dtype; kv_cache_dtype: None = the compute dtype.
    attention: "auto" (FlashInfer, else torch with a logged reason), "flashinfer", "torch".
    ops: the layers' elementwise glue on the FlashInfer path: "flashinfer" (ops.py's fused
    kernels, the default) or "torch" (the reference ops); None = the SARATHI_CUDA_OPS environment
    variable, else "flashinfer". The fused kernels round once, in fp32, where Hugging Face rounds
    to bf16 between steps: their greedy tokens can leave Hugging Face's bf16 ones after a few
    tokens, so they are held to an fp32 reference instead, as close to it as the reference ops
    (tests/gpu/test_backend.py, passed on an H200); the torch ops are held to Hugging Face's bf16
    results. The fused kernels are fewer and larger (the figures: bench/results/gpu/README.md)."""
    ops = ops or os.environ.get("SARATHI_CUDA_OPS") or "flashinfer"
    if ops not in ("torch", "flashinfer"):
        raise ValueError(f"unknown CUDA ops {ops!r} (SARATHI_CUDA_OPS); choose torch or flashinfer")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but torch sees no CUDA device "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
    if attention not in ("auto", "flashinfer", "torch"):
        raise ValueError(f"unknown CUDA attention {attention!r}; choose auto, flashinfer or torch")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if compute_dtype is None:
        compute_dtype = CudaBackend.default_dtype
    kv = kv_cache_dtype or compute_dtype
    reason = None if attention == "torch" else flashinfer_unavailable_reason()
    if attention == "flashinfer" and reason:
        raise ValueError(f"attention 'flashinfer' requested but {reason}")
    if attention == "torch" or reason:
        if reason:
            log.warning("CUDA worker falls back to the torch attention path, no CUDA graphs: %s", reason)
        return CudaBackend(device, TorchAttention(), LinearMethod(), kv, compute_dtype,
                           note=f"fallback: {reason}" if reason else "")
    return CudaBackend(device, FlashInferAttention(device, kv), LinearMethod(), kv, compute_dtype,
                       scratch_blocks=1, graph_runner_class=CudaGraphRunner,
                       ops=FlashInferOps() if ops == "flashinfer" else Ops())
