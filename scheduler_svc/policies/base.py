"""The policy interface: a policy decides, once per iteration, which requests get how many tokens.

A policy sees only a StepContext: the running requests split into decodes and prefills, the
head of the waiting queue, and four moves (admit, reserve a decode's next block, take tokens,
shrink the last chunk). Memory, preemption and the request counters stay in the scheduler, so
a policy is a few lines and adding one touches one file plus the registry.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_svc.request import Request, RequestStatus
from shared.config import SchedulerConfig

if TYPE_CHECKING:
    from scheduler_svc.scheduler import Scheduler


class StepContext:
    """The batch being built in one schedule() call.

    chunks: (request, number of tokens) in batch order; num_tokens: their sum plus the draft
    tokens (speculative decoding: `drafts`, given by Policy.take_drafts), in tokens.
    Requests in flight (in a batch not yet updated) are invisible: a request is in at most
    one in-flight batch. In a batch planned ahead (`ahead`: async scheduling) the
    requests of the one batch in flight are visible again: a partial prefill as a prefill, one
    whose chunk samples as a decode (Scheduler.can_run_ahead), so a policy plans as if that
    batch were done.
    """

    def __init__(self, sched: "Scheduler", ahead: bool = False):
        self._sched = sched
        self.ahead = ahead
        self.chunks: list[list] = []       # [request, num_tokens]; a list so shrink can edit
        self.num_tokens = 0                # tokens, draft tokens included
        self._planned: set[str] = set()
        self.drafts: dict[str, list[int]] = {}   # req_id -> draft tokens after its decode token

    # -- what there is ------------------------------------------------------------------------
    def decodes(self) -> list[Request]:
        """Running requests whose next step is one decode token, oldest admitted first."""
        sched, ahead = self._sched, self.ahead
        return [r for r in sched.running
                if (r.is_decode and not r.in_flight) or (ahead and sched.can_run_ahead(r))]

    def prefills(self) -> list[Request]:
        """Running requests with prompt (or recompute) tokens left, not yet in this batch."""
        planned = self._planned  # checked first: after take_all_decodes most requests are in it
        busy = 2 if self.ahead else 1   # ahead: a chunk in flight may be followed by the next
        return [r for r in self._sched.running
                if r.req_id not in planned and r.in_flight < busy and r.num_new_tokens > 0
                and not r.is_decode]

    @property
    def num_running(self) -> int:
        """All admitted requests, in flight or not."""
        return len(self._sched.running)

    @property
    def has_waiting(self) -> bool:
        return bool(self._sched.waiting)

    # -- moves ----------------------------------------------------------------------------------
    def take(self, req: Request, num_tokens: int) -> None:
        """Put num_tokens of req's next tokens into the batch (1 <= n <= num_new_tokens)."""
        assert num_tokens >= 1, "a chunk has at least one token"
        self.chunks.append([req, num_tokens])
        self.num_tokens += num_tokens
        self._planned.add(req.req_id)

    def shrink_last(self, num_tokens: int) -> None:
        """Drop num_tokens from the last chunk (it keeps at least one token)."""
        chunk = self.chunks[-1]
        assert 0 <= num_tokens < chunk[1]
        chunk[1] -= num_tokens
        self.num_tokens -= num_tokens

    def reserve_decode(self, req: Request) -> bool:
        """Make room for req's next token, preempting the newest running requests that are
        not in this batch if memory is short. False if req itself was preempted (it was the
        newest) or is no longer running."""
        return req.status is RequestStatus.RUNNING and self._sched.reserve_slot(req, self._planned)

    def admit_next(self, max_new_tokens: int | None = None) -> Request | None:
        """Admit the head of the waiting queue if the running set has room (max_num_seqs) and
        memory has its blocks (with the watermark). max_new_tokens caps its tokens, except in
        an empty batch: a prompt longer than the cap then runs alone rather than never.
        FCFS: if the head does not fit, nobody behind it is admitted."""
        waiting = self._sched.waiting
        if not waiting:
            return None
        head = waiting[0]
        if max_new_tokens is not None and self.chunks and head.num_tokens > max_new_tokens:
            return None
        return head if self._sched.admit_head() else None


class Policy:
    """One scheduling policy. Subclasses set `name` and implement plan()."""

    name = "base"

    def __init__(self, config: SchedulerConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len  # tokens

    def plan(self, ctx: StepContext) -> None:
        """Fill ctx with this iteration's chunks through ctx's moves."""
        raise NotImplementedError

    def observe(self, num_tokens: int, seconds: float, now: float) -> None:
        """A batch of num_tokens tokens took `seconds` from schedule() to update() (scheduler
        clock; with a pipeline, its time in flight). Most policies ignore it."""

    # -- shared building blocks ---------------------------------------------------------------
    def take_drafts(self, ctx: StepContext, budget: int) -> None:
        """Speculative decoding: draft tokens for this batch's decodes, from the budget the
        policy's own work left over. Call last, once the decodes and prefills are in.

        The rule (every policy, with its own budget: tau for sarathi, max_num_batched_tokens
        for the whole-prompt policies):
        1. no drafts while any request waits, or when a prefill chunk of this batch was cut
           short: the budget is then wanted by prompts, and drafts would take it from them;
        2. draft tokens only from what is left of the budget after the batch's decodes (one
           token each) and prefill chunks: left = budget - ctx.num_tokens;
        3. each decode asks for k drafts by its recent acceptance and the measured cost of a
           draft (Speculator.k_for) and gets what its proposer finds; `left` is shared out one
           draft token at a time, round-robin over the decodes in batch order (oldest first),
           so under a tight budget every decode gets about the same number (a decode-only batch
           now and then gets none: Speculator.needs_baseline);
        4. drafts take KV blocks only while the watermark stays free, and never preempt.
        As load rises the leftover shrinks to 0 (rules 1-2), so k -> 0 and the batches are the
        ones without speculation: capacity never drops below it. Whether rules 1-2 left room is
        kept (Scheduler.spec_room): with async scheduling too, the loop plans ahead only where
        they did not (speculation has the low load, planning ahead the rest)."""
        sched = ctx._sched
        spec = sched.speculator
        if spec is None:
            return
        cut = any(n < req.num_new_tokens for req, n in ctx.chunks)      # a prefill cut short
        sched.spec_room = not (ctx.has_waiting or ctx.num_tokens >= budget or cut)
        if not sched.spec_room:
            return                                                        # rules 1-2
        from scheduler_svc.speculative import eligible
        decodes = [req for req, n in ctx.chunks if n == 1 and req.is_decode]
        if len(decodes) == len(ctx.chunks) and spec.needs_baseline(len(decodes)):
            return       # a decode-only batch without drafts: the baseline a draft's cost is measured by
        asks = [(req, spec.k_for(req, len(decodes))) for req in decodes if eligible(req)]
        wants = []
        for (req, _), drafts in zip(asks, spec.propose_many(asks)):   # one call: a draft model batches them
            if drafts:
                wants.append((req, drafts))
            else:
                spec.no_draft(req)
        left = budget - ctx.num_tokens
        given = [0] * len(wants)
        while left > 0:
            moved = False
            for i, (_, drafts) in enumerate(wants):
                if left > 0 and given[i] < len(drafts):
                    given[i] += 1
                    left -= 1
                    moved = True
            if not moved:
                break
        bm = sched.block_manager
        for (req, drafts), g in zip(wants, given):
            g = bm.extend_for_drafts(req, g) if g else 0
            if g:
                ctx.drafts[req.req_id] = drafts[:g]
                ctx.num_tokens += g
            else:
                spec.no_draft(req)

    def take_all_decodes(self, ctx: StepContext, budget: int | None = None) -> None:
        """Every running decode, oldest first, while ctx.num_tokens < budget (None: no cap)."""
        for req in ctx.decodes():
            if budget is not None and ctx.num_tokens >= budget:
                return
            if ctx.reserve_decode(req):
                ctx.take(req, 1)

    def take_whole_prompts(self, ctx: StepContext, max_tokens: int | None = None) -> None:
        """Admit waiting requests and take all their tokens, while they fit max_tokens."""
        while True:
            left = None if max_tokens is None else max_tokens - ctx.num_tokens
            req = ctx.admit_next(left)
            if req is None:
                return
            ctx.take(req, req.num_new_tokens)

    def take_chunked_prefills(self, ctx: StepContext, budget: int) -> None:
        """Partial prefills first, then new requests, each cut to the budget left (tokens)."""
        for req in ctx.prefills():
            if ctx.num_tokens >= budget:
                return
            ctx.take(req, min(req.num_new_tokens, budget - ctx.num_tokens))
        while ctx.num_tokens < budget and (req := ctx.admit_next()) is not None:
            ctx.take(req, min(req.num_new_tokens, budget - ctx.num_tokens))
