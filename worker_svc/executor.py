"""The worker's engine: one hybrid batch in, the sampled tokens out.

Executor owns the model weights and the paged KV cache tensors. It trusts the scheduler's
block bookkeeping (which blocks belong to whom) but checks every batch against its own limits
(context length, block ids, vocabulary) so that a bad batch is an error, not a silent
corruption of another request's KV.
"""
from __future__ import annotations

import logging
import time

import torch

from shared.config import DEFAULT_CPU_BLOCKS, ModelInfo, WorkerConfig, cdiv, single_rank_layout
from shared.messages import Batch, BatchOutput, SeqChunk
from shared.model_source import resolve_model
from worker_svc.backends import select_backend
from worker_svc.device_sampler import DeviceSampler
from worker_svc.kv_cache import PagedKVCache
from worker_svc.loader import load_weights, read_config
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.model.linear import TensorParallel
from worker_svc.sampler import Sampler, SamplerOutput

log = logging.getLogger("sarathi.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KV_CACHE_DTYPES = {**DTYPES, "float16": torch.float16}


class BatchError(ValueError):
    """A batch the worker cannot execute as sent; names the request and the problem."""


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """'auto' -> float32 on CPU, bfloat16 on CUDA.

    Why float32 on CPU (bench/results/engine_cpu/engine_iteration.md): this machine's CPUs have
    avx512_bf16 but no AMX, so torch's bf16 matmuls run at about half the fp32 rate; prefill
    chunks and hybrid batches are 1.4-1.8x slower in bf16, single decodes are no faster, and bf16
    wins only on long-context decode-only batches (half the KV bytes to read)."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_kv_cache_dtype(name: str) -> torch.dtype | None:
    """'auto' -> None (the backend's default for its device); else the named dtype."""
    if name == "auto":
        return None
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


class Executor:
    """Loads config.model, then allocates config.cache.num_blocks KV blocks per layer (0: auto,
    see WorkerConfig), then captures the backend's CUDA graphs if it has them.

    Weights are checked before anything is allocated, then go tensor by tensor to the device in
    the compute dtype (worker_svc.loader.LazyWeights), so a bad model path or file raises first.

    parallel (worker_svc.parallel.ParallelConfig): this rank's place in a tp x pp replica. Its
    fit to the model (heads, kv heads, layers) is checked from the config alone, before any
    weight is read; then the rank joins the process group, keeps its stage's layers (and their
    KV cache) sharded over its TP group. Only the last stage returns sampled tokens.
    """

    def __init__(self, config: WorkerConfig, tp: TensorParallel = TensorParallel(),
                 sampler_seed: int | None = None, weights: tuple | None = None, parallel=None):
        """weights: (ModelConfig, name -> tensor mapping) to use instead of loading config.model
        (the GPU benchmark's random-init Llama-3-8B shapes, bench/gpu_engine_iteration.py)."""
        self.config = config
        self.dtype = resolve_dtype(config.dtype, config.device)
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.backend = select_backend(config.device, self.dtype,
                                      resolve_kv_cache_dtype(config.kv_cache_dtype),
                                      attention=config.attention, weight_quant=config.weight_quant)
        dev = self.backend.device
        self.parallel = None
        self._recv_wait_s = 0.0     # seconds the last batch waited for the previous stage
        if weights is None:
            source = resolve_model(config.model)
            name = source.name
            if parallel is not None and parallel.world_size > 1:
                from worker_svc import parallel as par
                arch = read_config(source)
                par.check(arch, parallel)                 # before any weight is read
                par.init_distributed(parallel, str(dev))
                self.parallel = par.Parallel(parallel, arch.num_layers, dev)
                tp = self.parallel.tp
            cfg, weights = load_weights(source, self.dtype, dev)
        else:
            (cfg, weights), name = weights, "random-init"
        self.model = LlamaForCausalLM(cfg, weights, self.dtype, self.backend, tp, self.parallel).to(dev)
        del weights
        self.model_cfg = cfg
        self.block_size = config.cache.block_size
        kv_heads = cfg.num_kv_heads // tp.world_size
        blocks_per_seq = cdiv(cfg.max_position_embeddings, self.block_size)
        self.backend.bind(cfg.num_heads // tp.world_size, kv_heads, cfg.head_dim, self.dtype,
                          cfg.head_dim ** -0.5, config.max_num_seqs * blocks_per_seq)
        num_blocks = config.cache.num_blocks or self._auto_num_blocks(cfg, kv_heads)
        # scratch blocks (ids num_blocks ..) are the backend's; the scheduler never sees them
        self.cache = PagedKVCache(len(self.model.layers), num_blocks + self.backend.scratch_blocks,
                                  self.block_size, kv_heads, cfg.head_dim,
                                  self.backend.kv_cache_dtype, dev)
        self.sampler = Sampler(sampler_seed, eos_token_ids=cfg.eos_token_ids)
        self.device_sampler = DeviceSampler(sampler_seed) if self.backend.sample_on_device else None
        self.model_info = ModelInfo(
            name=name, max_model_len=cfg.max_position_embeddings,
            vocab_size=cfg.vocab_size, eos_token_ids=list(cfg.eos_token_ids),
            num_layers=cfg.num_layers, block_size=self.block_size,
            num_blocks=num_blocks, backend=self.backend.describe())
        self.graphs = None
        if config.cuda_graphs and self.backend.make_graph_runner is not None and self.parallel is None:
            from worker_svc.cuda_graphs import capture_sizes
            self.graphs = self.backend.make_graph_runner(
                self.model, self.cache, self.backend.attention, capture_sizes(config.max_num_seqs),
                num_blocks, dev)
        log.info("worker backend: %s; %d KV blocks of %d tokens; CUDA graphs %s",
                 self.backend.describe(), num_blocks, self.block_size,
                 "on" if self.graphs is not None else "off")
        if self.parallel is not None:
            p = self.parallel
            log.info("%s: layers %d..%d of %d", p.config.describe(), p.layers[0], p.layers[1] - 1,
                     cfg.num_layers)

    @property
    def parallel_info(self) -> dict:
        """This rank's place in the replica (the worker's "info" reply; the scheduler checks it)."""
        pc = self.parallel.config if self.parallel is not None else None
        if pc is None:
            return single_rank_layout()
        return {"rank": pc.rank, "world_size": pc.world_size, "tp": pc.tp, "pp": pc.pp,
                "layers": list(self.parallel.layers)}

    def _auto_num_blocks(self, cfg, kv_heads: int) -> int:
        """cache.num_blocks == 0: DEFAULT_CPU_BLOCKS on a CPU; on CUDA sized from free memory
        after a profiling pass at the largest batch (worker_svc.kv_sizing)."""
        if self.backend.device.type != "cuda":
            return DEFAULT_CPU_BLOCKS
        if self.parallel is not None:   # the profiling pass would run one stage alone
            raise ValueError("with --tp/--pp > 1 on CUDA give --num-blocks (the same on every rank)")
        from worker_svc import kv_sizing
        c = self.config
        tokens = max(1, c.max_num_batched_tokens)
        peak, other = kv_sizing.profile_peak_bytes(
            self.model, self.backend, cfg.num_layers, kv_heads, cfg.head_dim, self.block_size,
            tokens, cfg.max_position_embeddings, self.backend.device)
        per_block = kv_sizing.block_bytes(cfg.num_layers, self.block_size, kv_heads, cfg.head_dim,
                                          self.backend.kv_cache_dtype)
        total = torch.cuda.get_device_properties(self.backend.device).total_memory
        blocks = kv_sizing.blocks_that_fit(total, peak, other, c.gpu_memory_utilization, per_block)
        blocks -= self.backend.scratch_blocks
        log.info("KV cache sized from device memory: %d blocks (%.1f GiB; profile peak %.1f GiB "
                 "at %d tokens, other use %.1f GiB, utilization %.2f)", blocks,
                 blocks * per_block / 2**30, peak / 2**30, tokens, other / 2**30,
                 c.gpu_memory_utilization)
        return max(blocks, 1)

    def free(self, req_ids: list[str]) -> None:
        """Drop per-request state: the sampler's token histories (blocks are the scheduler's).
        Unknown ids are fine."""
        self.sampler.free(req_ids)

    def execute(self, batch: Batch) -> BatchOutput:
        """Run one iteration; sampled holds a token exactly for the seqs with sample=True (and
        logprobs for those that asked)."""
        t0 = time.perf_counter()
        self.free(batch.freed_req_ids)
        par = self.parallel
        if par is None or par.is_last:   # token histories (penalties) only where tokens are drawn
            self.sampler.observe(batch.seqs)
        wall0 = time.time()
        due, logits, t1, t2 = self._forward(batch)
        ds = self.device_sampler
        # TP: every rank of the last stage draws, TP rank 0's tokens are kept (broadcast)
        agree = par.broadcast_tokens if par is not None else None
        if logits is None:       # a pipeline stage before the last: its activations were sent
            due, out = [], SamplerOutput([])
        elif ds is not None and all(ds.supports(s.sampling) for s in due):   # only ids cross to the host
            out = SamplerOutput(ds.sample(logits, [s.sampling for s in due], [s.output_index for s in due]))
            if agree is not None:
                out.tokens = agree(out.tokens)
        else:  # penalties, min_tokens, logprobs: the host sampler (it keeps the token histories)
            out = self.sampler.sample_chunks(logits.cpu(), due, agree=agree)
        t3 = time.perf_counter()
        timings = {"prepare_s": t1 - t0, "forward_s": t2 - t1, "sample_s": t3 - t2, "total_s": t3 - t0}
        if par is not None:
            # time.time() seconds: busy = [start, end] minus the wait for the previous stage
            timings.update(rank=par.rank, stage=par.stage, start=wall0,
                           end=wall0 + (t3 - t0), recv_wait_s=self._recv_wait_s)
        return BatchOutput(batch.batch_id, {s.req_id: tok for s, tok in zip(due, out.tokens)}, timings,
                           {due[i].req_id: lp for i, lp in out.logprobs.items()})

    def compute_logits(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Like execute (K/V are written) but return the float32 logits [V] of each seq with
        sample=True instead of sampling (tests, scoring)."""
        due, logits, _, _ = self._forward(batch)
        if logits is None:
            return {}
        logits = logits.cpu()
        return {s.req_id: logits[i] for i, s in enumerate(due)}

    def _forward(self, batch: Batch):
        t0 = time.perf_counter()
        due = [s for s in batch.seqs if s.sample]
        self._recv_wait_s = 0.0
        if not batch.seqs:
            return due, torch.empty(0, self.model_info.vocab_size), t0, t0
        for s in batch.seqs:
            self._check(s)
        ids = torch.tensor([t for s in batch.seqs for t in s.token_ids], dtype=torch.int64)
        pos: list[int] = []         # Python ranges, one tensor: not one arange per sequence
        for s in batch.seqs:
            pos.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
        positions = torch.tensor(pos, dtype=torch.int64)
        dev = self.backend.device
        specs = [(s.start_pos, len(s.token_ids), s.block_table) for s in batch.seqs]
        if self.graphs is not None:
            logits = self._graph_forward(batch, specs, ids, positions, due)
            if logits is not None:
                return due, logits, t0, time.perf_counter()
        meta = self.backend.attention.build_metadata(specs, self.block_size, dev)
        rows, row = [], 0
        for s in batch.seqs:
            row += len(s.token_ids)
            if s.sample:
                rows.append(row - 1)       # the chunk's last token predicts the next one
        t1 = time.perf_counter()
        par, hidden = self.parallel, None
        if par is not None and not par.is_first:
            hidden, self._recv_wait_s = par.recv_hidden(batch.batch_id, len(ids),
                                                        self.model_cfg.hidden_size, self.dtype)
        out = self.model(ids.to(dev), positions.to(dev), self.cache, meta,
                         torch.tensor(rows, dtype=torch.int64, device=dev), hidden)
        if par is not None and not par.is_last:
            par.send_hidden(out, batch.batch_id)
            return due, None, t1, time.perf_counter()
        return due, out, t1, time.perf_counter()    # logits stay on the device

    def _graph_forward(self, batch: Batch, specs, ids, positions, due) -> torch.Tensor | None:
        """Logits of the due rows through a captured CUDA graph, or None (run eagerly) when the
        batch is not decode-only or is larger than the largest graph."""
        if len(ids) != len(specs) or len(specs) > self.graphs.sizes[-1]:
            return None
        from worker_svc.flashinfer_meta import build_paged_batch
        logits = self.graphs.run(build_paged_batch(specs, self.block_size), ids.tolist(), positions.tolist())
        if logits is None or len(due) == len(specs):
            return logits
        keep = [i for i, s in enumerate(batch.seqs) if s.sample]
        return logits.index_select(0, torch.tensor(keep, device=logits.device))

    def _check(self, s: SeqChunk) -> None:
        n, end = len(s.token_ids), s.start_pos + len(s.token_ids)
        if n == 0:
            raise BatchError(f"request {s.req_id}: empty token_ids (an empty prompt cannot be run)")
        if s.start_pos < 0:
            raise BatchError(f"request {s.req_id}: negative start_pos {s.start_pos}")
        if end > self.model_info.max_model_len:
            raise BatchError(f"request {s.req_id}: positions up to {end} exceed the model's "
                             f"context length max_model_len={self.model_info.max_model_len}")
        need = cdiv(end, self.block_size)
        if len(s.block_table) < need:
            raise BatchError(f"request {s.req_id}: block table has {len(s.block_table)} blocks, "
                             f"{need} needed for {end} tokens of block_size {self.block_size}")
        blocks, nblk = s.block_table[:need], self.model_info.num_blocks
        # min/max first (C loops): the per-id scan below runs only to name the bad ids
        bad = [b for b in blocks if not 0 <= b < nblk] if min(blocks) < 0 or max(blocks) >= nblk else []
        if bad:
            raise BatchError(f"request {s.req_id}: block ids {bad[:5]} outside the cache's "
                             f"{self.model_info.num_blocks} blocks")
        vocab = self.model_info.vocab_size
        if min(s.token_ids) < 0 or max(s.token_ids) >= vocab:
            raise BatchError(f"request {s.req_id}: token id outside the vocabulary [0, {vocab})")
