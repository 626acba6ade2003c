"""A deterministic, torch-free executor for tests and benchmarks.

SimExecutor keeps a fake KV cache of token ids, written through each SeqChunk's block table,
and derives each sampled token from the context it reads back through the block table. The
next token is therefore a function of the sequence's tokens only (like a greedy model), not
of how the scheduler chunked, preempted or shared it, *unless* the scheduler got the memory
wrong: a bad block table, a shared block overwritten, or a read of a slot never written
changes the output or raises. Tests compare outputs against a run with ample memory.

Optional cost model + SimClock: the clock advances by the modelled iteration time, so TTFT /
TBT metrics can be computed without a GPU.
"""
from __future__ import annotations

from typing import Callable

from shared.messages import Batch, BatchOutput, SeqChunk, fill_pending


class SimClock:
    """A manual clock (seconds) to inject into the Scheduler: `clock()` reads it."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def linear_cost_model(base_s: float = 0.010, per_prefill_token_s: float = 5e-5,
                      per_decode_token_s: float = 2e-4) -> Callable[[Batch], float]:
    """Iteration time (seconds) = base + per-token costs; a decode is a 1-token sampled chunk
    after the prompt. Crude, but enough to see stalls in simulated TBT."""
    def cost(batch: Batch) -> float:
        t = base_s
        for s in batch.seqs:
            t += per_decode_token_s if s.is_decode else per_prefill_token_s * len(s.token_ids)
            if s.num_draft_tokens:   # a decode that verifies drafts: its first token is a decode
                t += per_decode_token_s - per_prefill_token_s
        return t
    return cost


class SimExecutor:
    """execute(batch) -> BatchOutput, deterministic.

    block_size: tokens per KV block (must match the scheduler's).
    vocab_size: sampled tokens are in [1, vocab_size).
    scripts: req_id -> tokens to emit by output index (e.g. to end with an EOS); past the
        script's end, tokens come from the context hash.
    verify_kv: read the whole context back through the block table for every sampled token
        (O(context) per token); False derives the token from (req_id, position) only, for
        benchmarks (then nothing about memory is checked).
    spec_acceptance: how draft tokens (speculative decoding) are judged. None: as a greedy
        model would, a draft is accepted iff it is the token this executor derives at its
        position (so the output equals a run without drafts); a probability: each draft is
        accepted with it (given the ones before it were), whatever its value, from a seeded
        generator (the simulator's acceptance parameter).
    """

    def __init__(self, block_size: int, vocab_size: int = 32000,
                 scripts: dict[str, list[int]] | None = None, verify_kv: bool = True,
                 cost_model: Callable[[Batch], float] | None = None,
                 clock: SimClock | None = None, spec_acceptance: float | None = None,
                 spec_seed: int = 0):
        import random
        self.block_size = block_size
        self.spec_acceptance = spec_acceptance
        self._spec_rng = random.Random(spec_seed)
        self.vocab_size = vocab_size
        self.scripts = scripts or {}
        self.verify_kv = verify_kv
        self.cost_model = cost_model
        self.clock = clock
        self.kv: dict[int, list[int | None]] = {}   # block id -> token id per slot
        self.num_batches = 0
        self.computed_tokens = 0                     # tokens whose K/V were written, total
        # disaggregation: the simulated workers reachable by KV address (shared dict), this one's
        # address in it, and kv_fail(kv_send) -> a failure reason or None (fault tests)
        self.kv_fabric: dict[str, "SimExecutor"] = {}
        self.kv_address: str | None = None
        self.kv_fail: Callable | None = None
        self.kv_blocks_received = 0
        # kv_cost(kv_send) -> seconds of the send: added to the iteration (and to the clock) as a
        # separate term, reported as the request's kv_transfer_s (None: free)
        self.kv_cost: Callable | None = None
        self._last_sampled: dict[str, int] = {}   # the tokens decodes planned ahead read

    def join_fabric(self, fabric: dict[str, "SimExecutor"], address: str) -> "SimExecutor":
        """Receive KV blocks at `address` of `fabric` (shared by the simulated workers of a test)."""
        self.kv_fabric, self.kv_address = fabric, address
        fabric[address] = self
        return self

    def execute(self, batch: Batch) -> BatchOutput:
        batch = fill_pending(batch, self._last_sampled)   # async scheduling's decodes planned ahead
        # Strict model of attention: every sequence reads the KV cache as it was before this
        # batch, plus its own chunk. A scheduler that let one sequence read blocks another
        # sequence writes in the same batch fails here (a real kernel makes no such promise).
        prefixes = {s.req_id: self._read(s, s.start_pos) for s in batch.seqs
                    if s.sample and self.verify_kv}
        for seq in batch.seqs:
            self._write(seq)
        sampled, accepted = {}, {}
        for s in batch.seqs:
            if s.num_draft_tokens:
                accepted[s.req_id], sampled[s.req_id] = self._verify(s, prefixes.get(s.req_id))
            elif s.sample:
                sampled[s.req_id] = self._next_token(s, prefixes.get(s.req_id))
        cost = self.cost_model(batch) if self.cost_model else 0.0
        if self.clock is not None:
            self.clock.advance(cost)
        self.num_batches += 1
        self._last_sampled = sampled
        out = BatchOutput(batch.batch_id, sampled, {"forward_s": cost}, accepted=accepted)
        for send in batch.kv_sends:
            self._send_kv(send, out)
        return out

    def _send_kv(self, send, out: BatchOutput) -> None:
        """Copy the slots of send.src_blocks into the receiver's send.dst_blocks (a KvSend)."""
        reason = self.kv_fail(send) if self.kv_fail is not None else None
        dst = self.kv_fabric.get(send.dst_address)
        if reason is None and dst is None:
            reason = f"no KV receiver at {send.dst_address}"
        if reason is not None:
            out.kv_failed[send.req_id] = reason
            return
        for s, d in zip(send.src_blocks, send.dst_blocks):
            dst.kv[d] = list(self.kv.get(s, [None] * self.block_size))
        dst.kv_blocks_received += len(send.dst_blocks)
        seconds = self.kv_cost(send) if self.kv_cost is not None else 0.0
        if self.clock is not None:
            self.clock.advance(seconds)
        out.timings["kv_transfer_s"] = out.timings.get("kv_transfer_s", 0.0) + seconds
        # bytes as SmolLM2-135M's bf16 KV would take: 30 layers x K,V x 3 heads x 64 dims x 2 B
        out.kv_sent[send.req_id] = {"kv_transfer_s": seconds,
                                    "kv_bytes": len(send.src_blocks) * self.block_size * 23040}

    def _slot(self, seq: SeqChunk, pos: int) -> tuple[list, int]:
        block = seq.block_table[pos // self.block_size]
        return self.kv.setdefault(block, [None] * self.block_size), pos % self.block_size

    def _write(self, seq: SeqChunk) -> None:
        self.computed_tokens += len(seq.token_ids)
        if not self.verify_kv:
            return
        for i, tok in enumerate(seq.token_ids):
            slots, off = self._slot(seq, seq.start_pos + i)
            slots[off] = tok

    def _read(self, seq: SeqChunk, end: int) -> list[int]:
        """Tokens at positions [0, end) through seq's block table; all must be written."""
        context = []
        for pos in range(end):
            slots, off = self._slot(seq, pos)
            if slots[off] is None:
                raise AssertionError(f"{seq.req_id}: KV slot of position {pos} was never written")
            context.append(slots[off])
        return context

    def _next_token(self, seq: SeqChunk, prefix: list[int] | None, upto: int | None = None,
                    extra: int = 0) -> int:
        """The token after prefix + seq.token_ids[:upto] (all of them by default); extra: how
        many tokens past seq.output_index it is (a draft position)."""
        tokens = seq.token_ids if upto is None else seq.token_ids[:upto]
        script = self.scripts.get(seq.req_id, ())
        if seq.output_index + extra < len(script):
            return script[seq.output_index + extra]
        if prefix is None:  # verify_kv off
            return 1 + hash((seq.req_id, seq.start_pos + len(tokens))) % (self.vocab_size - 1)
        return 1 + hash(tuple(prefix + tokens)) % (self.vocab_size - 1)

    def _verify(self, seq: SeqChunk, prefix: list[int] | None) -> tuple[list[int], int]:
        """(accepted drafts, the token after them) of a decode with drafts."""
        k = seq.num_draft_tokens
        n = len(seq.token_ids) - k
        drafts = seq.token_ids[n:]
        accepted: list[int] = []
        for i, d in enumerate(drafts):
            if self.spec_acceptance is None:
                ok = self._next_token(seq, prefix, n + i, i) == d
            else:
                ok = self._spec_rng.random() < self.spec_acceptance
            if not ok:
                break
            accepted.append(d)
        return accepted, self._next_token(seq, prefix, n + len(accepted), len(accepted))


def sim_engine(policy: str = "sarathi", *, token_budget: int = 512, block_size: int = 16,
               num_blocks: int = 1024, max_num_seqs: int = 128, max_model_len: int = 2048,
               max_num_batched_tokens: int = 4096, enable_prefix_caching: bool = False,
               watermark: float = 0.0, tile_size: int = 0, eos_token_ids: tuple = (0,),
               vocab_size: int = 32000, verify_kv: bool = True, clock=None,
               adaptive_tbt_slo_s: float = 0.0, speculative: str = "off",
               num_speculative_tokens: int = 4, async_scheduling: bool = False, **executor_kw):
    """An EngineLoop over a Scheduler and a SimExecutor, configured in one call (tests,
    benchmarks). Extra keyword arguments go to SimExecutor (scripts, cost_model,
    spec_acceptance). With speculative decoding on and spec_acceptance given, drafts come from
    the synthetic proposer (always k of them), judged by that acceptance."""
    from scheduler_svc.engine_loop import EngineLoop  # imported here: sim_executor stays a leaf
    from scheduler_svc.scheduler import Scheduler
    from shared.config import CacheConfig, ModelInfo, SchedulerConfig
    sched = Scheduler(
        SchedulerConfig(policy=policy, token_budget=token_budget, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
                        watermark=watermark, tile_size=tile_size,
                        adaptive_tbt_slo_s=adaptive_tbt_slo_s, speculative=speculative,
                        num_speculative_tokens=num_speculative_tokens,
                        async_scheduling=async_scheduling),
        CacheConfig(block_size=block_size, num_blocks=num_blocks),
        ModelInfo("sim", max_model_len, vocab_size, list(eos_token_ids), block_size=block_size,
                  num_blocks=num_blocks),
        clock=clock if clock is not None else SimClock())
    executor = SimExecutor(block_size, vocab_size, verify_kv=verify_kv, clock=sched.clock
                           if isinstance(sched.clock, SimClock) else None, **executor_kw)
    if sched.speculator is not None and executor.spec_acceptance is not None:
        from scheduler_svc.speculative.synthetic import SyntheticProposer
        sched.speculator.proposer = SyntheticProposer()   # acceptance is the parameter
    return EngineLoop(sched, executor)
