"""The scheduler: owns every request's state and all KV-block bookkeeping. Torch-free.

One iteration is `schedule()` -> (an executor runs the Batch) -> `update(batch, output)`.
Counters advance when a batch is scheduled, so a pipeline may schedule the next micro-batch
before this one's output is back; a request is in at most one in-flight batch, except with
async scheduling (SchedulerConfig.async_scheduling), where a batch scheduled `ahead` continues
the requests of the one batch in flight: a partial prefill with its next chunk, a request
whose chunk samples with a decode of the token still to come (PENDING_TOKEN). Given the same
arrivals, the same clock and the same calls, it makes the same batches.

Step boundaries (the start of schedule() and the end of update()) are where aborts take
effect and where blocks of finished requests have been freed.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.policies import StepContext, make_policy
from scheduler_svc.request import Request, RequestStatus
from scheduler_svc.speculative import make_speculator
from shared.config import CacheConfig, ModelInfo, SchedulerConfig
from shared.limits import check_context_length, check_token_ids
from shared.messages import PENDING_TOKEN, Batch, BatchOutput, SeqChunk, TokenEvent
from shared.sampling import InvalidRequestError, SamplingParams


class Scheduler:
    """add_request / abort -> schedule() -> Batch -> update(batch, output) -> TokenEvents.

    Limits: prompt + max_tokens <= min(sched_config.max_model_len, model_info.max_model_len)
    tokens, and must fit the KV cache less the watermark; block size and block count come from
    cache_config; EOS ids from model_info.

    Token events are numbered here and nowhere else: TokenEvent.index is the 0-based output
    index of token_id (an EOS that ends a request is emitted, with finish_reason "stop"); an
    abort or error event has token_id None and index = the number of tokens generated, one past
    the request's last token event (a refused request: rejection_event, index 0). Tokens are
    never taken back (a preempted request keeps them), so the indices of one request only grow.
    """

    def __init__(self, sched_config: SchedulerConfig, cache_config: CacheConfig,
                 model_info: ModelInfo, clock: Callable[[], float] = time.monotonic):
        self.config = sched_config
        self.model_info = model_info
        self.clock = clock  # seconds; all timestamps come from it
        self.max_model_len = min(sched_config.max_model_len, model_info.max_model_len)  # tokens
        self.eos_token_ids = frozenset(model_info.eos_token_ids)
        self.block_manager = BlockManager(
            cache_config.num_blocks, cache_config.block_size,
            int(sched_config.watermark * cache_config.num_blocks),
            sched_config.enable_prefix_caching)
        self.policy = make_policy(sched_config, self.max_model_len)
        self.speculator = make_speculator(sched_config, model_info)   # None: speculation off
        self.requests: dict[str, Request] = {}   # every unfinished request
        self.waiting: deque[Request] = deque()   # FCFS; preempted requests go to the head
        self.running: list[Request] = []         # admitted, in admission order (oldest first)
        self._freed_ids: list[str] = []          # for the next batch's freed_req_ids
        self._events: list[TokenEvent] = []      # end events of aborts, for the next caller
        self._abort_lock = threading.Lock()
        self._abort_ids: list[tuple[str, str | None]] = []
        self._next_batch_id = 0
        self._scheduled_at: dict[int, float] = {}   # batch id -> clock at schedule(), until update()
        self._planned_s: dict[int, float] = {}      # batch id -> seconds its planning took (speculation)
        self._last_update_at = float("-inf")        # clock at the end of the last update()
        self._aborting: set[str] = set()            # aborts waiting for a batch in flight
        self.spec_room = False   # speculation's rules left room for drafts in the last batch planned
        self.reserved: dict[str, Request] = {}   # blocks held for requests prefilled elsewhere
        self._counters = dict(num_preemptions=0, prefix_cache_hit_tokens=0,
                              prefix_cache_query_tokens=0, num_finished=0, num_aborted=0,
                              last_prefill_tokens=0, last_decode_tokens=0, last_batch_size=0,
                              last_draft_tokens=0,
                              num_adopted=0, num_handed_off=0)

    # -- requests in -----------------------------------------------------------------------------
    def add_request(self, req_id: str, prompt_token_ids: list[int],
                    sampling: SamplingParams | None = None,
                    arrival_time: float | None = None,
                    share_prompt_with: str | None = None) -> Request:
        """Queue a request; raises InvalidRequestError if it could never be served as asked.
        arrival_time: seconds on this scheduler's clock (default: now). share_prompt_with: a
        sibling request with the same prompt (n > 1): if it is running here, this one is admitted
        once the sibling's prompt KV is computed and shares its full prompt blocks."""
        sampling = SamplingParams() if sampling is None else sampling
        self.validate_request(req_id, prompt_token_ids, sampling)
        arrival = self.clock() if arrival_time is None else arrival_time
        req = Request(req_id, [int(t) for t in prompt_token_ids], sampling, arrival,
                      share_prompt_with=share_prompt_with)
        if sampling.logprobs is not None:
            req.logprobs = []
        self.requests[req_id] = req
        self.waiting.append(req)
        return req

    def validate_request(self, req_id: str, prompt: list[int], sampling: SamplingParams) -> None:
        """Raise InvalidRequestError (param, code, message) if add_request would refuse it."""
        sampling.validate()
        if req_id in self.requests:
            raise InvalidRequestError(f"request id {req_id!r} is already in use", "req_id",
                                      "duplicate_request_id")
        if not prompt:
            raise InvalidRequestError("the prompt must contain at least one token", "prompt")
        check_token_ids(prompt, self.model_info.vocab_size)
        check_context_length(len(prompt), sampling.max_tokens, self.max_model_len)
        total = len(prompt) + sampling.max_tokens
        bm = self.block_manager
        usable = bm.num_blocks - bm.watermark_blocks
        if bm.blocks_for(total) > usable:
            raise InvalidRequestError(
                f"the request needs {bm.blocks_for(total)} KV blocks ({total} tokens) but the "
                f"KV cache can give one request at most {usable} blocks of {bm.block_size} "
                "tokens", "max_tokens", "kv_cache_too_small")

    @staticmethod
    def rejection_event(req_id: str, num_prompt_tokens: int, error: InvalidRequestError) -> TokenEvent:
        """The one event of a request add_request refused: an "error" end at index 0 (nothing
        was generated)."""
        return TokenEvent(req_id, 0, None, "error", error.message, num_prompt_tokens)

    def abort(self, req_id: str, error: str | None = None) -> None:
        """Stop a request at the next step boundary (thread-safe). With `error`, it finishes
        with reason "error" and that message; otherwise "abort". Unknown ids are ignored."""
        with self._abort_lock:
            self._abort_ids.append((req_id, error))

    # -- one iteration ----------------------------------------------------------------------------
    def schedule(self, ahead: bool = False) -> Batch | None:
        """Plan the next iteration with the policy; None if there is nothing to run now.
        ahead (async scheduling; see can_schedule_ahead): one batch is in flight and this one
        may continue its requests (run on the worker after it)."""
        self._process_aborts()
        if ahead and not self.config.async_scheduling:
            raise ValueError("schedule(ahead=True) needs SchedulerConfig.async_scheduling")
        self.spec_room = False        # the policy's take_drafts says otherwise
        ctx = StepContext(self, ahead)
        planning = self.clock() if self.speculator is not None else 0.0
        self.policy.plan(ctx)
        if not ctx.chunks:
            return None
        now = self.clock()
        drafts = ctx.drafts
        seqs = [self._schedule_chunk(req, n, now, drafts.get(req.req_id)) for req, n in ctx.chunks]
        batch = Batch(self._next_batch_id, seqs, self._freed_ids, ahead=self.config.async_scheduling)
        self._scheduled_at[batch.batch_id] = now
        if self.speculator is not None:   # the drafts' proposing (a draft model's steps) is their cost too
            self._planned_s[batch.batch_id] = now - planning
        self._next_batch_id += 1
        self._freed_ids = []
        self._count_batch(seqs)
        return batch

    def _schedule_chunk(self, req: Request, n: int, now: float,
                        drafts: list[int] | None = None) -> SeqChunk:
        """drafts: draft tokens to verify after a decode's token (speculative decoding); they
        are not the request's tokens, so num_computed_tokens advances by n only. A chunk that
        starts past the known tokens is a decode scheduled ahead: its token is PENDING_TOKEN
        and its output index counts the token to come."""
        start = req.num_computed_tokens
        req.num_computed_tokens = start + n
        req.in_flight += 1
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        # penalties and constraints read the whole sequence: a worker new to it must learn what
        # precedes the chunk
        prior = req.token_ids[:start] if start and req.sampling.reads_history else None
        known = len(req.token_ids)
        if start == known:                      # ahead: can_run_ahead allowed one decode
            return SeqChunk(req.req_id, [PENDING_TOKEN], start, list(req.block_table), True,
                            req.sampling, req.num_output_tokens + 1, prior)
        tokens = req.token_ids[start:start + n]
        if drafts:
            req.draft_token_ids = drafts
            tokens = tokens + drafts
        return SeqChunk(req.req_id, tokens, start, list(req.block_table),
                        req.num_computed_tokens == known, req.sampling,
                        req.num_output_tokens, prior, len(drafts) if drafts else 0)

    # -- async scheduling -----------------------------------------------------------------------
    @staticmethod
    def _ahead_capable(sampling: SamplingParams) -> bool:
        """Sampling that needs no earlier token on the host (grammars and penalties do)."""
        return not sampling.reads_history

    def can_schedule_ahead(self) -> bool:
        """The engine loop may plan a batch while one is in flight: async scheduling is on, every
        request in flight samples without reading its earlier tokens on the host and carries no
        drafts to verify (one that does would otherwise run only every other batch), and, with
        speculative decoding on, the last batch planned left no room for drafts (spec_room:
        where it does, a decode planned ahead could not be given any)."""
        if not self.config.async_scheduling or (self.speculator is not None and self.spec_room):
            return False    # with speculation on, low load (room for drafts) is speculation's
        return all(self._ahead_capable(r.sampling) and not r.draft_token_ids
                   for r in self.running if r.in_flight)

    def can_run_ahead(self, req: Request) -> bool:
        """In a batch planned ahead: req's chunk in flight samples a token and its next decode
        may run before that token is back (not when that token may be its last by length, nor
        while an abort waits for it)."""
        return (req.in_flight == 1 and req.num_computed_tokens == len(req.token_ids)
                and req.status is RequestStatus.RUNNING and req.req_id not in self._aborting
                and self._ahead_capable(req.sampling) and not req.draft_token_ids
                and req.num_output_tokens + 1 < req.sampling.max_tokens
                and len(req.token_ids) + 1 < self.max_model_len)

    def update(self, batch: Batch, output: BatchOutput) -> list[TokenEvent]:
        """Take an executed batch's sampled tokens; returns the TokenEvents of this step (and
        of aborts processed since the last call). Finished requests free their blocks here."""
        if output.batch_id != batch.batch_id:
            raise ValueError(f"output of batch {output.batch_id} given for batch {batch.batch_id}")
        now = self.clock()
        scheduled_at = self._scheduled_at.pop(batch.batch_id, None)
        if scheduled_at is not None:   # the policy may learn from iteration times (adaptive tau)
            if self.config.async_scheduling:   # planned ahead: it ran from the previous one's end
                scheduled_at = max(scheduled_at, self._last_update_at)
            self.policy.observe(batch.num_tokens, now - scheduled_at, now)
            if self.speculator is not None:   # and speculation what a draft token costs
                decodes = sum(1 for s in batch.seqs if s.is_decode or s.num_draft_tokens)
                drafts = sum(s.num_draft_tokens for s in batch.seqs)
                self.speculator.observe_batch(decodes, drafts, batch.num_tokens - decodes - drafts,
                                              now - scheduled_at + self._planned_s.pop(batch.batch_id, 0.0))
        for seq in batch.seqs:
            req = self.requests.get(seq.req_id)
            if req is None or not req.in_flight:
                continue  # finished meanwhile (e.g. aborted with an error by the service)
            req.in_flight -= 1
            # this chunk's K/V are written: key what they complete (a chunk planned ahead may
            # have advanced num_computed_tokens further)
            self.block_manager.cache_computed_blocks(
                req, seq.start_pos + len(seq.token_ids) - seq.num_draft_tokens)
            if seq.num_draft_tokens:
                self._append_verified(req, seq, output, now)
            elif seq.sample:
                self._append_token(req, self._sampled(output, seq.req_id), now,
                                   output.logprobs.get(seq.req_id))
        self._process_aborts()
        self._last_update_at = now
        return self.take_events()

    def _append_verified(self, req: Request, seq: SeqChunk, output: BatchOutput, now: float) -> None:
        """A decode with drafts came back: its accepted drafts become tokens (their K/V were
        computed by the chunk), then the token sampled after them; a finish (stop, length) on
        the way ends it there. The blocks of rejected drafts' slots are freed (rollback)."""
        token = self._sampled(output, seq.req_id)
        accepted = output.accepted.get(seq.req_id) or []
        k = seq.num_draft_tokens
        if len(accepted) > k or accepted != req.draft_token_ids[:len(accepted)]:
            raise ValueError(f"executor accepted {accepted!r} for {seq.req_id!r}, whose drafts "
                             f"were {req.draft_token_ids!r}")
        req.draft_token_ids = []
        if self.speculator is not None:
            self.speculator.observe(req, k, len(accepted))
        lps = output.accepted_logprobs.get(seq.req_id) or [None] * len(accepted)
        for tok, lp in zip(accepted, lps):
            self._append_token(req, int(tok), now, lp)
            if req.is_finished:
                return
            req.num_computed_tokens += 1
        self._append_token(req, token, now, output.logprobs.get(seq.req_id))
        if not req.is_finished:
            self.block_manager.truncate(req, req.num_tokens)

    @staticmethod
    def _sampled(output: BatchOutput, req_id: str) -> int:
        try:
            return output.sampled[req_id]
        except KeyError:
            raise ValueError(f"executor returned no token for {req_id!r}, which was due one") from None

    def _append_token(self, req: Request, token: int, now: float, logprobs: list | None = None) -> None:
        req.token_ids.append(token)
        req.token_times.append(now)
        if req.first_token_time is None:
            req.first_token_time = now
        reason = self._finish_reason(req, token)
        ev = TokenEvent(req.req_id, req.num_output_tokens - 1, token, reason,
                        num_prompt_tokens=req.num_prompt_tokens)
        if logprobs is not None and req.logprobs is not None:
            req.logprobs.append(logprobs)
            ev.logprob, ev.top_logprobs = logprobs[0], [list(p) for p in zip(logprobs[1], logprobs[2])]
        self._events.append(ev)
        if reason is not None:
            self._finish(req, reason)

    def _finish_reason(self, req: Request, token: int) -> str | None:
        sp = req.sampling
        n = len(req.token_ids)
        if n - req.num_prompt_tokens > sp.min_tokens and (
                token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids)):
            return "stop"
        if n - req.num_prompt_tokens >= sp.max_tokens or n >= self.max_model_len:
            return "length"
        return None

    def take_events(self) -> list[TokenEvent]:
        """Events produced since the last call (update() returns them too)."""
        events, self._events = self._events, []
        return events

    # -- memory moves used by the policies' StepContext ----------------------------------------
    def admit_head(self) -> bool:
        """Move the head of the waiting queue to running if max_num_seqs and memory allow."""
        req = self.waiting[0]
        bm = self.block_manager
        shared = self._sibling_blocks(req) if req.share_prompt_with else None
        if shared is False:
            return False  # its sibling's prompt KV is being computed: wait for it
        if len(self.running) >= self.config.max_num_seqs or not bm.can_allocate(req, shared):
            return False
        self.waiting.popleft()
        hit_tokens = bm.allocate(req, shared)
        if bm.cache is not None:
            self._counters["prefix_cache_hit_tokens"] += hit_tokens
            self._counters["prefix_cache_query_tokens"] += req.num_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def _sibling_blocks(self, req: Request) -> list[int] | None | bool:
        """The full prompt blocks req can share with its sibling (same prompt, computed), None
        when there is nothing to share, False when req should wait: the sibling runs here and
        its prompt KV is not computed yet. A sibling that is waiting or preempted is not waited
        for (it may be queued behind req)."""
        sib = self.requests.get(req.share_prompt_with)
        n = (req.num_prompt_tokens - 1) // self.block_manager.block_size  # keep >= 1 token to compute
        if sib is None or n == 0 or sib.status is not RequestStatus.RUNNING:
            return None
        need = n * self.block_manager.block_size
        if sib.prompt_token_ids[:need] != req.prompt_token_ids[:need]:
            return None
        if sib.in_flight or sib.num_computed_tokens < need:
            return False
        return sib.block_table[:n]

    def reserve_slot(self, req: Request, planned: set[str]) -> bool:
        """Blocks for req's next token; preempts the newest running requests that are neither
        in flight nor planned (possibly req itself) until there is room."""
        bm = self.block_manager
        if len(req.block_table) * bm.block_size > req.num_computed_tokens:
            return True  # fast path: the slot of the token to compute is already there
        while not bm.can_append(req):
            victim = next((r for r in reversed(self.running)
                           if not r.in_flight and r.req_id not in planned), None)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is req:
                return False
        bm.append(req)
        return True

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: free the blocks, keep every token (prompt and generated),
        and requeue at the head; the whole sequence is prefilled again later."""
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
        self._freed_ids.append(req.req_id)
        self._counters["num_preemptions"] += 1

    def on_batches_abandoned(self) -> None:
        """No batch scheduled so far will be answered (a step failed, or the workers were lost):
        no request stays marked in flight, so aborts wait no longer and the policy sees every
        running request again. Their tokens were never appended: what to do with the requests
        is the caller's (fail_batch, abort or on_workers_lost)."""
        self._scheduled_at.clear()
        self._planned_s.clear()
        for req in self.requests.values():
            req.in_flight = 0
            req.draft_token_ids = []

    def on_workers_lost(self) -> None:
        """The workers lost their KV (a worker died or restarted): nothing in flight will be
        answered, every running request goes back to the waiting queue to be recomputed with the
        tokens it generated (oldest first at the head), and no cached prefix may be found again."""
        self.on_batches_abandoned()
        for req in reversed(list(self.running)):
            self._preempt(req)
        for req_id in list(self.reserved):
            self.release_reservation(req_id)
        self.block_manager.forget_cached_contents()

    # -- disaggregation: requests that move between schedulers (scheduler_svc.pools) ----------------
    def reserve_for_handoff(self, src: Request) -> Request | None:
        """Blocks on this scheduler's KV cache for the prompt of `src` (a request being prefilled
        on another worker), taken now so its K/V can be written into them; None when memory or
        max_num_seqs leave no room. The reservation (a Request holding the blocks, prefix-cache
        hits included: num_computed_tokens = the cached prefix, which need not be sent) is held
        in `reserved` until adopt() or release_reservation()."""
        if len(self.running) + len(self.reserved) >= self.config.max_num_seqs:
            return None
        req = Request(src.req_id, list(src.prompt_token_ids), src.sampling, src.arrival_time)
        if not self.block_manager.can_allocate(req):
            return None
        self.block_manager.allocate(req)
        self.reserved[req.req_id] = req
        return req

    def release_reservation(self, req_id: str) -> None:
        """Free a reservation's blocks (the handoff will not happen); unknown ids are ignored."""
        req = self.reserved.pop(req_id, None)
        if req is not None:
            self.block_manager.free(req)

    def adopt(self, src: Request) -> Request:
        """Take over `src`, whose prompt K/V were just written into its reservation here and
        whose first token was sampled elsewhere: it runs here from now on (its next step is a
        decode; token events continue at index num_output_tokens)."""
        req = self.reserved.pop(src.req_id)
        req.token_ids = list(src.token_ids)
        req.num_computed_tokens = src.num_prompt_tokens
        req.arrival_time, req.first_scheduled_time = src.arrival_time, src.first_scheduled_time
        req.first_token_time, req.token_times = src.first_token_time, list(src.token_times)
        req.logprobs, req.num_preemptions = src.logprobs, src.num_preemptions
        req.status = RequestStatus.RUNNING
        self.block_manager.cache_computed_blocks(req)
        self.requests[req.req_id] = req
        self.running.append(req)
        self._counters["num_adopted"] += 1
        return req

    def release_handoff(self, req_id: str) -> Request:
        """Drop a running request whose K/V another worker now holds, without an end event:
        its blocks here are freed and the worker forgets it (freed_req_ids)."""
        req = self.requests.pop(req_id)
        self.block_manager.free(req)
        self._forget_speculation(req)
        self.running.remove(req)
        self._freed_ids.append(req_id)
        self._counters["num_handed_off"] += 1
        return req

    def take_back(self, req_id: str) -> Request | None:
        """Remove an unfinished request that is not in flight, freeing its blocks, to be queued on
        another scheduler (requeue) and recomputed there with the tokens it has; None if unknown."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        self.block_manager.free(req)
        self._forget_speculation(req)
        (self.running if req.status is RequestStatus.RUNNING else self.waiting).remove(req)
        if req.first_scheduled_time is not None:
            self._freed_ids.append(req_id)
        req.num_computed_tokens, req.in_flight = 0, 0
        req.status = RequestStatus.PREEMPTED if req.num_output_tokens else RequestStatus.WAITING
        return req

    def requeue(self, req: Request, front: bool = True) -> None:
        """Queue a request taken back from another scheduler (it keeps its tokens, times and
        id; it is recomputed from position 0 here)."""
        self.requests[req.req_id] = req
        (self.waiting.appendleft if front else self.waiting.append)(req)

    def apply_aborts(self) -> list[TokenEvent]:
        """Process pending aborts now, without scheduling (no worker to run a batch); returns
        the events produced since the last take_events()."""
        self._process_aborts()
        return self.take_events()

    def fail_batch(self, batch: Batch, error: str) -> None:
        """The batch's output will never come (worker failure): its requests end with an
        "error" event at the next step boundary."""
        for seq in batch.seqs:
            req = self.requests.get(seq.req_id)
            if req is not None:
                req.in_flight = 0
                self.abort(seq.req_id, error=error)

    def _forget_speculation(self, req: Request) -> None:
        """req leaves this scheduler unfinished: its proposer's state here goes (a draft model's
        blocks are this scheduler's), the request keeps nothing of it."""
        if self.speculator is not None:
            self.speculator.finish(req)
        req.spec_state, req.draft_token_ids = {}, []

    # -- finishing ------------------------------------------------------------------------------
    def _process_aborts(self) -> None:
        with self._abort_lock:
            pending, self._abort_ids = self._abort_ids, []
        deferred = []
        for req_id, error in pending:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.in_flight:  # its batch is still out: wait for the boundary after it
                deferred.append((req_id, error))
                continue
            self._events.append(TokenEvent(req_id, req.num_output_tokens, None,
                                           "error" if error else "abort", error,
                                           req.num_prompt_tokens))
            self._finish(req, "error" if error else "abort", error)
        self._aborting = {req_id for req_id, _ in deferred}   # not to be scheduled ahead
        if deferred:
            with self._abort_lock:
                self._abort_ids[:0] = deferred

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        was_running = req.status is RequestStatus.RUNNING
        req.status, req.finish_reason, req.error = RequestStatus.FINISHED, reason, error
        if self.speculator is not None:
            self.speculator.finish(req)
        req.finish_time = self.clock()
        self.block_manager.free(req)
        if was_running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        del self.requests[req.req_id]
        if req.first_scheduled_time is not None:
            self._freed_ids.append(req.req_id)
        self._counters["num_aborted" if reason in ("abort", "error") else "num_finished"] += 1

    # -- introspection --------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _count_batch(self, seqs: list[SeqChunk]) -> None:
        decode = sum(1 for s in seqs if s.is_decode or s.num_draft_tokens)
        drafts = sum(s.num_draft_tokens for s in seqs)
        total = sum(len(s.token_ids) for s in seqs)
        self._counters.update(last_prefill_tokens=total - decode - drafts, last_decode_tokens=decode,
                              last_draft_tokens=drafts, last_batch_size=len(seqs))

    def stats(self) -> dict:
        """running, waiting (requests); num_free_blocks, num_total_blocks (blocks); kv_usage
        (fraction of blocks used); num_preemptions, num_finished, num_aborted (counts since
        start); prefix_cache_hit_tokens, prefix_cache_query_tokens (tokens since start);
        last_prefill_tokens, last_decode_tokens, last_draft_tokens, last_batch_size (the last batch
        scheduled; a decode with drafts counts one decode token and its drafts);
        with speculative decoding on, the speculator's counters (spec_proposed_tokens,
        spec_accepted_tokens, spec_acceptance_rate, spec_tokens_per_step: Speculator.stats)."""
        bm = self.block_manager
        spec = self.speculator.stats() if self.speculator is not None else {}
        return dict(running=len(self.running), waiting=len(self.waiting),
                    num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
                    kv_usage=bm.num_used_blocks / bm.num_blocks, **self._counters, **spec)
