"""The worker's model runner: one hybrid batch in, the sampled tokens out.

ModelRunner checks the batch, runs the model forward and samples. It owns the model
weights and the paged KV cache tensors; everything that differs per device (compute dtype for
"auto", KV capacity when none was given, the sampler, graph replay, the distributed backend)
is the DeviceBackend's answer (worker_svc.backends), never a device-string test here. It trusts
the scheduler's block bookkeeping (which blocks belong to whom) but checks every batch against
its own limits (context length, block ids, vocabulary) so that a bad batch is an error, not a
silent corruption of another request's KV. To the scheduler's engine loop it is an executor
(scheduler_svc.engine_loop.Executor: execute(batch) -> BatchOutput), in process or behind the
worker service.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field

import torch

from shared.config import ModelInfo, WorkerConfig, cdiv, single_rank_layout
from shared.messages import PENDING_TOKEN, Batch, BatchOutput, SeqChunk, fill_pending
from shared.model_source import resolve_model
from shared.tokenizer import load_tokenizer
from worker_svc.backends import Readback, parse_dtype, parse_kv_cache_dtype, select_backend
from worker_svc.kv_cache import PagedKVCache
from worker_svc.loader import load_weights, read_config
from worker_svc.model.linear import TensorParallel
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.sampling import SamplerOutput, Verified, draft_tokens, emitted_logprobs, verify

log = logging.getLogger("sarathi.worker")


class BatchError(ValueError):
    """A batch the worker cannot execute as sent; names the request and the problem."""


@dataclass(eq=False)
class Launched:
    """A batch ModelRunner.launch() started (its output: ModelRunner.finish()). due: the seqs
    that get a token, in row order; tokens: those tokens on the device, read back by `read`
    (drawn on the device) or None; sampled: req_id -> token once known on the host; out: the
    sampler's output then; timings: seconds (prepare_s, forward_s, sample_s)."""

    batch_id: int
    due: list[SeqChunk]
    t0: float                     # time.perf_counter() at launch
    wall0: float                  # time.time() at the forward pass
    timings: dict[str, float]
    tokens: torch.Tensor | None = None
    read: Readback | None = None
    out: SamplerOutput | None = None
    sampled: dict[str, int] | None = None
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list] = field(default_factory=dict)

    def ready(self) -> bool:
        """True when finish() would not wait for the device."""
        return self.sampled is not None or self.read.ready()

    def block(self) -> None:
        """Wait until ready() (a waiter thread's call: it reads nothing)."""
        if self.sampled is None:
            self.read.block()


class ModelRunner:
    """Loads config.model, then allocates config.cache.num_blocks KV blocks per layer (0: auto,
    the backend's num_kv_blocks), then captures the backend's graphs if it has them.

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
        dtype, kv_cache_dtype = parse_dtype(config.dtype), parse_kv_cache_dtype(config.kv_cache_dtype)
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.backend = select_backend(config.device, dtype, kv_cache_dtype,
                                      attention=config.attention, weight_quant=config.weight_quant)
        self.dtype = self.backend.compute_dtype
        dev = self.backend.device
        self.parallel = None
        self._recv_wait_s = 0.0     # seconds the last batch waited for the previous stage
        self._latest: Launched | None = None       # the last batch launched: what decodes planned ahead read
        self._unfinished: Launched | None = None   # launched, tokens still on the device
        if weights is None:
            source = resolve_model(config.model)
            name = source.name
            if parallel is not None and parallel.world_size > 1:
                from worker_svc import parallel as par
                arch = read_config(source)
                par.check(arch, parallel)                 # before any weight is read
                par.init_distributed(parallel, self.backend.dist_backend)
                self.parallel = par.Parallel(parallel, arch.num_layers, dev)
                tp = self.parallel.tp
            cfg, weights = load_weights(source, self.dtype, dev)
        else:
            (cfg, weights), name, source = weights, "random-init", None
        self.model = LlamaForCausalLM(cfg, weights, self.dtype, self.backend, tp, self.parallel).to(dev)
        del weights
        self.model_cfg = cfg
        self.block_size = config.cache.block_size
        kv_heads = cfg.num_kv_heads // tp.world_size
        blocks_per_seq = cdiv(cfg.max_position_embeddings, self.block_size)
        self.backend.bind(cfg.num_heads // tp.world_size, kv_heads, cfg.head_dim, self.dtype,
                          cfg.head_dim ** -0.5, config.max_num_seqs * blocks_per_seq)
        num_blocks = config.cache.num_blocks or self.backend.num_kv_blocks(
            self.model, cfg, kv_heads, self.block_size, config, distributed=self.parallel is not None)
        # scratch blocks (ids num_blocks ..) are the backend's; the scheduler never sees them
        self.cache = PagedKVCache(len(self.model.layers), num_blocks + self.backend.scratch_blocks,
                                  self.block_size, kv_heads, cfg.head_dim,
                                  self.backend.kv_cache_dtype, dev)
        self.sampler = self.backend.sampler(sampler_seed, cfg.eos_token_ids)
        # draws of draft verification (speculative decoding; unseeded sampled requests only)
        self.spec_generator = torch.Generator(device=dev)
        if sampler_seed is None:
            self.spec_generator.seed()
        else:
            self.spec_generator.manual_seed(sampler_seed)
        if source is not None:    # constrained decoding needs the model's tokenizer: loaded on first use
            self.sampler.guides.bind(functools.partial(load_tokenizer, source), cfg.vocab_size)
        self.model_info = ModelInfo(
            name=name, max_model_len=cfg.max_position_embeddings,
            vocab_size=cfg.vocab_size, eos_token_ids=list(cfg.eos_token_ids),
            num_layers=cfg.num_layers, block_size=self.block_size,
            num_blocks=num_blocks, backend=self.backend.describe())
        # a graph runs the whole model: with pipeline stages there is no whole model here
        self.graphs = None
        if config.cuda_graphs and self.parallel is None:
            self.graphs = self.backend.graph_runner(self.model, self.cache, config.max_num_seqs)
        stack = getattr(self.model, "stack", None)
        log.info("worker backend: %s; %d KV blocks of %d tokens; CUDA graphs %s; layers %s",
                 self.backend.describe(), num_blocks, self.block_size,
                 "on" if self.graphs is not None else "off",
                 f"in one call per step where it applies ({stack.name})" if stack is not None else "one by one")
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

    @property
    def device_sampler(self):
        """The sampler that draws on the device (the CUDA backend's), or None: tokens are drawn
        by the host sampler only."""
        return getattr(self.sampler, "device_sampler", None)

    def free(self, req_ids: list[str]) -> None:
        """Drop per-request state: the sampler's token histories (blocks are the scheduler's).
        Unknown ids are fine."""
        self.sampler.free(req_ids)

    def execute(self, batch: Batch) -> BatchOutput:
        """Run one iteration; sampled holds a token exactly for the seqs with sample=True (and
        logprobs for those that asked). A seq with draft tokens (SeqChunk.num_draft_tokens) is
        verified instead of sampled: its accepted drafts go to accepted, the token after them to
        sampled (worker_svc.sampling.speculative). A decode planned ahead (async scheduling)
        computes the token its request's chunk in the batch before sampled. = finish(launch())."""
        return self.finish(self.launch(batch))

    def launch(self, batch: Batch) -> "Launched":
        """Start one iteration; finish() returns its output. Where the tokens are drawn on the
        device (the CUDA backend, requests without host-only parameters, no TP or drafts) this
        returns once the work is queued there, tokens not read back, so the caller can launch
        the next batch first: launch(n + 1) may come before finish(n) (the worker service does
        that with async scheduling), and then batch n + 1's decodes planned ahead take batch n's
        tokens on the device. One batch at most may wait to be finished when the next is
        launched; finish() in launch order."""
        t0 = time.perf_counter()
        prev = self._latest
        if prev is not None and prev.sampled is None and prev is not self._unfinished:
            raise RuntimeError("launch() with two batches not finished: finish() the older first")
        batch, pending = self._pending_tokens(batch, prev)
        self.free(batch.freed_req_ids)
        par = self.parallel
        if par is None or par.is_last:   # token histories (penalties) only where tokens are drawn
            self.sampler.observe(batch.seqs)
            # grammar masks are filled on a host thread while the forward pass runs
            self.sampler.prepare([s for s in batch.seqs if s.sample and not s.num_draft_tokens])
        wall0 = time.time()
        due, logits, t1, t2 = self._forward(batch, pending)
        run = Launched(batch.batch_id, due, t0, wall0, {"prepare_s": t1 - t0, "forward_s": t2 - t1})
        if logits is None:       # a pipeline stage before the last: its activations were sent
            run.due, run.out = [], SamplerOutput([])
        elif any(s.num_draft_tokens for s in due):
            run.due, run.out = self._verify(due, logits, run.accepted, run.accepted_logprobs, par)
        elif par is None and (draw := getattr(self.sampler, "draw_on_device", None)) is not None \
                and (tokens := draw(logits, due)) is not None:
            run.tokens = tokens
            run.read = self.backend.read_back(tokens)
        else:   # TP: every rank of the last stage draws, TP rank 0's tokens are kept (broadcast)
            run.out = self.sampler.sample_chunks(logits, due, agree=par.broadcast_tokens if par is not None else None)
        if run.out is not None:
            run.sampled = {s.req_id: tok for s, tok in zip(run.due, run.out.tokens)}
        run.timings["sample_s"] = time.perf_counter() - t2
        self._latest = run
        self._unfinished = run if run.sampled is None else None
        return run

    def finish(self, run: "Launched") -> BatchOutput:
        """The output of a launched batch (waits for its tokens if they are still on the device)."""
        if run.sampled is None:
            tokens = run.read.wait()
            run.out = SamplerOutput(tokens)
            run.sampled = {s.req_id: tok for s, tok in zip(run.due, tokens)}
            self.sampler.guides.advance(run.due, tokens)
            if self._unfinished is run:
                self._unfinished = None
        t3 = time.perf_counter()
        timings = dict(run.timings, total_s=t3 - run.t0)
        par = self.parallel
        if par is not None:
            # time.time() seconds: busy = [start, end] minus the wait for the previous stage
            timings.update(rank=par.rank, stage=par.stage, start=run.wall0,
                           end=run.wall0 + (t3 - run.t0), recv_wait_s=self._recv_wait_s)
        return BatchOutput(run.batch_id, dict(run.sampled), timings,
                           {run.due[i].req_id: lp for i, lp in run.out.logprobs.items()},
                           accepted=run.accepted, accepted_logprobs=run.accepted_logprobs)

    def _pending_tokens(self, batch: Batch, prev: "Launched | None"):
        """(batch, pending): decodes planned ahead carry PENDING_TOKEN (async scheduling); their
        token is the one `prev`, the batch launched before, sampled for their request. Known on
        the host: filled in (a copy of the batch). Still on the device: the token becomes 0 here
        and pending = (rows of the batch's flat token ids, prev's tokens at those rows), which
        _forward copies in on the device."""
        if not any(s.token_ids and s.token_ids[0] == PENDING_TOKEN for s in batch.seqs):
            return batch, None
        try:
            if prev is None:
                raise ValueError("no batch ran before it on this worker")
            if prev.sampled is not None:
                return fill_pending(batch, prev.sampled), None
            rows_of = {s.req_id: i for i, s in enumerate(prev.due)}
            seqs, dst, src, row = [], [], [], 0
            for s in batch.seqs:
                if s.is_ahead:
                    if s.req_id not in rows_of:
                        raise ValueError(f"request {s.req_id}: a pending token the batch before did "
                                         "not sample")
                    dst.append(row)
                    src.append(rows_of[s.req_id])
                    s = dataclasses.replace(s, token_ids=[0])
                seqs.append(s)
                row += len(s.token_ids)
        except ValueError as e:
            raise BatchError(f"{e} (a decode planned ahead must follow its request's sampling "
                             "chunk on the same worker)") from None
        src_t = self.backend.to_device(torch.tensor(src, dtype=torch.int64))
        return dataclasses.replace(batch, seqs=seqs), (dst, prev.tokens.index_select(0, src_t))

    def _verify(self, due: list[SeqChunk], logits: torch.Tensor, accepted: dict, accepted_lps: dict,
                par) -> tuple[list[SeqChunk], SamplerOutput]:
        """Sample the plain due seqs (one row each) and verify the seqs with drafts (k + 1 rows
        each) of one batch; fills accepted / accepted_lps. Returns (due, output) in one order."""
        plain_rows, plain, spans, row = [], [], [], 0
        for s in due:
            n = 1 + s.num_draft_tokens
            if s.num_draft_tokens:
                spans.append((s, row, n))
            else:
                plain.append(s)
                plain_rows.append(row)
            row += n
        order: list[SeqChunk] = []
        out = SamplerOutput([])
        if plain:
            sub = logits.index_select(0, torch.tensor(plain_rows, dtype=torch.int64, device=logits.device))
            got = self.sampler.sample_chunks(sub, plain, agree=par.broadcast_tokens if par is not None else None)
            order.extend(plain)
            out.tokens.extend(got.tokens)
            out.logprobs.update(got.logprobs)
        eos = list(self.model_cfg.eos_token_ids)
        # a constrained chunk's rows are masked by its grammar after the drafts before each
        masks = [self.sampler.guides.draft_masks(s, draft_tokens(s)) if s.sampling.constraint is not None
                 else None for s, _, _ in spans]
        results = [verify(logits[start:start + n], s, eos, self.spec_generator, mask)
                   for (s, start, n), mask in zip(spans, masks)]
        if par is not None and par.tp.world_size > 1:
            results = self._agree(spans, results, logits, eos, par, masks)
        for (s, _, _), v in zip(spans, results):
            if v.logprobs is not None:
                accepted_lps[s.req_id] = v.logprobs[:-1]
                out.logprobs[len(order)] = v.logprobs[-1]
            accepted[s.req_id] = v.accepted
            order.append(s)
            out.tokens.append(v.token)
        return order, out

    @staticmethod
    def _agree(spans, results, logits, eos, par, masks):
        """TP: every rank of the last stage verifies; TP rank 0's results are kept (broadcast
        as k + 2 ints a seq: the number accepted, the accepted drafts padded to k, the token),
        with logprobs of the kept tokens."""
        flat = []
        for (s, _, n), v in zip(spans, results):
            flat += [len(v.accepted)] + v.accepted + [0] * (n - 1 - len(v.accepted)) + [v.token]
        flat = par.broadcast_tokens(flat)
        kept, i = [], 0
        for (s, start, n), v, mask in zip(spans, results, masks):
            a = flat[i]
            acc, token = flat[i + 1:i + 1 + a], flat[i + n]
            i += n + 1
            if (acc, token) != (v.accepted, v.token):
                v = Verified(acc, token, None if v.logprobs is None else
                             emitted_logprobs(logits[start:start + n], s, eos, acc + [token], mask))
            kept.append(v)
        return kept

    def compute_logits(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Like execute (K/V are written) but return the float32 logits [V] of each seq with
        sample=True instead of sampling (tests, scoring); [k + 1, V] for a seq with k drafts."""
        due, logits, _, _ = self._forward(*self._pending_tokens(batch, self._latest))
        if logits is None:
            return {}
        logits, got, row = logits.cpu(), {}, 0
        for s in due:
            k = s.num_draft_tokens
            got[s.req_id] = logits[row:row + k + 1] if k else logits[row]
            row += k + 1
        return got

    def _forward(self, batch: Batch, pending=None):
        """(the due seqs, their logits [S, V] float32 on the device or None on a pipeline stage
        before the last, start of the forward pass, end): checks the batch first. A seq with k
        draft tokens has k + 1 rows, in position order. pending: (rows, tokens on the device)
        to put into the flat token ids on the device (_pending_tokens)."""
        t0 = time.perf_counter()
        due = [s for s in batch.seqs if s.sample]
        self._recv_wait_s = 0.0
        if not batch.seqs:
            return due, torch.empty(0, self.model_info.vocab_size), t0, t0
        for s in batch.seqs:
            self._check(s)
        ids = [t for s in batch.seqs for t in s.token_ids]
        pos: list[int] = []         # Python ranges, one tensor: not one arange per sequence
        for s in batch.seqs:
            pos.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
        specs = []
        for s in batch.seqs:
            if s.num_draft_tokens:
                # each of the k + 1 positions as the decode at that position: one query attending
                # to the cache up to itself (the chunk's K/V are written first), so the rows take
                # the decode kernels and are the bits single decodes would give
                specs.extend((s.start_pos + i, 1, s.block_table) for i in range(len(s.token_ids)))
            else:
                specs.append((s.start_pos, len(s.token_ids), s.block_table))
        patch = None
        if pending is not None:
            dst = self.backend.to_device(torch.tensor(pending[0], dtype=torch.int64))

            def patch(input_ids: torch.Tensor, dst=dst, tokens=pending[1]) -> None:
                input_ids.index_copy_(0, dst, tokens)
        if self.graphs is not None and not any(s.num_draft_tokens for s in batch.seqs):
            logits = self.graphs.run(specs, ids, pos, patch)     # None: no graph for this batch
            if logits is not None:
                if len(due) < len(specs):
                    keep = [i for i, s in enumerate(batch.seqs) if s.sample]
                    logits = logits.index_select(0, self.backend.to_device(torch.tensor(keep)))
                return due, logits, t0, time.perf_counter()
        dev = self.backend.device
        to_dev = self.backend.to_device
        input_ids = to_dev(torch.tensor(ids, dtype=torch.int64))
        positions = to_dev(torch.tensor(pos, dtype=torch.int64))
        if patch is not None:
            patch(input_ids)
        meta = self.backend.attention.build_metadata(specs, self.block_size, dev)
        rows, row = [], 0
        for s in batch.seqs:
            row += len(s.token_ids)
            if s.num_draft_tokens:         # every position from the last sampled token on
                rows.extend(range(row - s.num_draft_tokens - 1, row))
            elif s.sample:
                rows.append(row - 1)       # the chunk's last token predicts the next one
        t1 = time.perf_counter()
        par, hidden = self.parallel, None
        if par is not None and not par.is_first:
            hidden, self._recv_wait_s = par.recv_hidden(batch.batch_id, len(ids),
                                                        self.model_cfg.hidden_size, self.dtype)
        out = self.model(input_ids, positions, self.cache, meta,
                         to_dev(torch.tensor(rows, dtype=torch.int64)), hidden)
        if par is not None and not par.is_last:
            par.send_hidden(out, batch.batch_id)
            return due, None, t1, time.perf_counter()
        return due, out, t1, time.perf_counter()    # logits stay on the device

    def _check(self, s: SeqChunk) -> None:
        n, end = len(s.token_ids), s.start_pos + len(s.token_ids)
        if n == 0:
            raise BatchError(f"request {s.req_id}: empty token_ids (an empty prompt cannot be run)")
        if s.num_draft_tokens and (not s.sample or not 0 < s.num_draft_tokens < n
                                   or s.sampling.has_penalties):
            raise BatchError(f"request {s.req_id}: {s.num_draft_tokens} draft tokens in a chunk of {n} "
                             "(drafts need a sampled chunk, at least one verified token, and no "
                             "penalties)")
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
