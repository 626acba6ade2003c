"""The proposer interface of speculative decoding, and the per-request rule for how many drafts
to ask for (k). Torch-free: proposers read token ids only.

A proposer names up to k tokens it guesses follow a request's tokens (prompt and output so
far); the worker verifies them all in one forward pass (worker_svc.sampling.speculative), so a
wrong guess costs its budget tokens and nothing else. A proposer keeps whatever per-request
state it wants in Request.spec_state under its own name (it goes away with the request).

How many drafts a request gets (`Speculator.k_for`), from its recent acceptance and what a draft
costs: with each draft accepted with probability alpha given the ones before, k drafts yield
E(k) = 1 + alpha + ... + alpha^k tokens in a step that k drafts make 1 + c k times as long,
where c is the time one draft token adds to a decode-only step, in units of that step without
drafts, proposing included (a step's time runs from the start of its planning, where a draft
model takes its steps, to its result). That time is added to every request of the batch, so
with D decodes in the batch the request gets the k in [0, max_k] that maximizes
E(k) / (1 + c D k) (the batch's tokens per unit of time, were every decode alike); k = 0 (no
drafts) unless some k does strictly better. So k also falls as the decodes of a batch grow in
number. c is measured online from the
decode-only batches (`observe_batch`: with and without drafts, per number of decodes; a batch
without drafts is scheduled now and then to keep that baseline): the median of the last 16
samples, each against the median of the last 8 steps without drafts, so that a stalled step
(the OS, a pause) moves neither; one sample counts as at most c = 1. c is kept per batch size
(the decodes rounded up to a power of two): a draft token's time is a larger share of a step of
one decode than of a step of many, so one c for all would make small batches draft too much
and large ones too little; a batch size not measured yet uses the median over all sizes. Until
measured c is 0.1; setting `cost` fixes one c for every batch size.
On a CPU, where each verified token costs real compute, c is large and k small; on a GPU,
where a decode step is bound by reading the weights, c is near 0. alpha is estimated by the
geometric-law estimate accepted / (accepted + rejections) over sums that decay by 0.8 a step
(so it follows the last five to ten verification steps), from a prior of one accepted and one
rejected draft (alpha = 0.5).
The sums decay at every verification step and, more slowly, at every decode without drafts.
Where drafts cost more than the prior justifies (c >= 0.5 with one decode: on a CPU), the rule
alone would never draft for a request without evidence, so it would never get any: a request
that has not had its drafts verified yet, and one that went `probe_every` decodes without
drafts (its drafts stopped being accepted, k = 0), is given one draft (a probe) whenever the rule
says 0; what the probe shows then decides its k. How many of
those drafts are scheduled is the policy's budget rule (scheduler_svc.policies.base).
"""
from __future__ import annotations

import statistics
from collections import deque
from typing import Protocol

from scheduler_svc.request import Request


class Proposer(Protocol):
    """name: the --speculative choice. propose(): at most k (>= 1) draft token ids for the
    positions after req.token_ids; fewer (or none) when it has no good guess. A proposer may
    also define finish(req), called when a request ends, and propose_batch(asks) for the
    (request, k) pairs of one batch at once, [drafts of each, in order] (a draft model: one
    forward pass a draft position for all of them); without it each is asked alone."""

    name: str

    def propose(self, req: Request, k: int) -> list[int]: ...


class Speculator:
    """A proposer plus the per-request k rule (module doc) and the counters of proposed and
    accepted drafts. max_k: the upper bound (--num-speculative-tokens)."""

    WINDOW = 16     # c is the median of the last WINDOW samples, a step's base the median of WINDOW / 2

    def __init__(self, proposer: Proposer, max_k: int, *, draft_cost: float = 0.1,
                 decay: float = 0.8, idle_decay: float = 0.98, baseline_every: int = 32,
                 probe_every: int = 64):
        if max_k < 1:
            raise ValueError(f"the number of speculative tokens must be >= 1, got {max_k}")
        self.proposer = proposer
        self.max_k = max_k
        self.default_cost = draft_cost   # c until measured (module doc)
        self._cost: float | None = None  # measured c over all batch sizes (median)
        self.decay, self.idle_decay = decay, idle_decay
        self.baseline_every = baseline_every
        self.probe_every = probe_every      # decodes without drafts before a probe (module doc)
        # decodes -> the last seconds of decode-only steps without drafts; the last c samples
        self._base: dict[int, deque[float]] = {}
        self._costs: deque[float] = deque(maxlen=self.WINDOW)
        self._costs_by: dict[int, deque[float]] = {}   # batch-size bucket -> its last samples
        self._timed = False                 # some batch came back with a time
        self._batches = 0
        self.proposed = 0       # drafts scheduled, since start
        self.accepted = 0       # drafts accepted, since start
        self.steps = 0          # decode steps that verified drafts
        self.emitted = 0        # tokens those steps produced (accepted + 1 each)

    @staticmethod
    def _sums(req: Request) -> list[float]:
        st = req.spec_state.get("_acceptance")
        if st is None:
            st = req.spec_state["_acceptance"] = [1.0, 1.0]     # prior: accepted, rejected
        return st

    def acceptance(self, req: Request) -> float:
        """The estimated probability that a request's next draft is accepted (given the ones
        before it were)."""
        acc, rej = self._sums(req)
        return acc / (acc + rej)

    def k_for(self, req: Request, num_decodes: int = 1) -> int:
        """Drafts worth asking for, from the request's acceptance, the cost of a draft and the
        decodes of the batch (module doc), capped by max_k and by the tokens it may still
        generate (one of which is the token after the drafts)."""
        left = req.sampling.max_tokens - req.num_output_tokens - 1
        if left <= 0:
            return 0
        alpha = self.acceptance(req)
        c = self.draft_cost_for(num_decodes) * max(1, num_decodes)
        best_k, best, gain, power = 0, 1.0, 1.0, 1.0
        for k in range(1, min(self.max_k, left) + 1):
            power *= alpha
            gain += power
            rate = gain / (1.0 + c * k)
            if rate > best:
                best_k, best = k, rate
        if best_k == 0:
            idle = req.spec_state.get("_idle")
            if idle is None or idle >= self.probe_every:
                return 1        # a probe: no evidence yet, or none for probe_every decodes
        return best_k

    @property
    def cost(self) -> float | None:
        """The measured c over all batch sizes (None until measured)."""
        return self._cost

    @cost.setter
    def cost(self, value: float | None) -> None:
        """A given c, for every batch size (what was measured per size is forgotten)."""
        self._cost = value
        self._costs_by.clear()

    @staticmethod
    def _bucket(num_decodes: int) -> int:
        """num_decodes rounded up to a power of two (1, 2, 4, 8, ...)."""
        return 1 << max(0, num_decodes - 1).bit_length()

    @property
    def draft_cost(self) -> float:
        """c of the module doc over all batch sizes: the measured one, or the default."""
        return self.default_cost if self._cost is None else self._cost

    def draft_cost_for(self, num_decodes: int) -> float:
        """c for a batch of num_decodes decodes: measured at that size, else draft_cost."""
        samples = self._costs_by.get(self._bucket(num_decodes))
        return statistics.median(samples) if samples else self.draft_cost

    def needs_baseline(self, num_decodes: int) -> bool:
        """Whether a decode-only batch of num_decodes decodes should run without drafts, to
        (re)measure the step time c is relative to: when none was measured for that many
        decodes, and every `baseline_every` batches. Never before any batch had a time."""
        self._batches += 1
        return self._timed and (num_decodes not in self._base or self._batches % self.baseline_every == 0)

    def observe_batch(self, num_decodes: int, num_drafts: int, num_other: int, seconds: float) -> None:
        """A batch came back after `seconds` (schedule to update): num_decodes decodes (with or
        without drafts), num_drafts draft tokens, num_other prefill tokens. Decode-only batches
        update c (module doc)."""
        if seconds <= 0 or num_decodes == 0:
            return
        self._timed = True
        if num_other:
            return
        times = self._base.get(num_decodes)
        if num_drafts == 0:
            if times is None:
                times = self._base[num_decodes] = deque(maxlen=self.WINDOW // 2)
            times.append(seconds)
        elif times:
            # at most 1: a draft token costs no more than the step it joins, whose decodes each
            # compute at least as much; a longer step is a stall (the OS, a pause), not the draft
            c = min(1.0, max(0.0, (seconds / statistics.median(times) - 1.0) / num_drafts))
            self._costs.append(c)
            self._cost = statistics.median(self._costs)
            bucket = self._bucket(num_decodes)
            if bucket not in self._costs_by:
                self._costs_by[bucket] = deque(maxlen=self.WINDOW)
            self._costs_by[bucket].append(c)

    def propose(self, req: Request, k: int) -> list[int]:
        return self.proposer.propose(req, k)[:k] if k > 0 else []

    def propose_many(self, asks: list[tuple[Request, int]]) -> list[list[int]]:
        """The drafts of each (request, k) of one batch, in order: the proposer's propose_batch
        for the pairs with k > 0 where it has one, else propose() for each."""
        asked = [(req, k) for req, k in asks if k > 0]
        batch = getattr(self.proposer, "propose_batch", None)
        if batch is None or len(asked) < 2:
            return [self.propose(req, k) for req, k in asks]
        got = iter(batch(asked))
        return [next(got)[:k] if k > 0 else [] for _, k in asks]

    def finish(self, req: Request) -> None:
        """req ended (any reason): a proposer that learns from outputs sees it."""
        finish = getattr(self.proposer, "finish", None)
        if finish is not None:
            finish(req)

    def no_draft(self, req: Request) -> None:
        """req decodes this step without drafts: its evidence ages a little."""
        if "_idle" in req.spec_state:
            req.spec_state["_idle"] += 1
        st = self._sums(req)
        st[0] = 1.0 + (st[0] - 1.0) * self.idle_decay
        st[1] = 1.0 + (st[1] - 1.0) * self.idle_decay

    def observe(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """A verification step of req: num_accepted of its num_drafts drafts were accepted."""
        req.spec_state["_idle"] = 0        # decodes without drafts since (k_for's probe)
        st = self._sums(req)
        st[0] = st[0] * self.decay + num_accepted
        st[1] = st[1] * self.decay + (1 if num_accepted < num_drafts else 0)
        self.proposed += num_drafts
        self.accepted += num_accepted
        self.steps += 1
        self.emitted += num_accepted + 1

    def stats(self) -> dict:
        """spec_proposed_tokens, spec_accepted_tokens (since start), spec_acceptance_rate
        (accepted / proposed), spec_tokens_per_step (tokens per verification step),
        spec_draft_cost (c of the module doc, in decode steps per draft token)."""
        return dict(spec_proposed_tokens=self.proposed, spec_accepted_tokens=self.accepted,
                    spec_acceptance_rate=self.accepted / self.proposed if self.proposed else 0.0,
                    spec_tokens_per_step=self.emitted / self.steps if self.steps else 0.0,
                    spec_draft_cost=self.draft_cost)
