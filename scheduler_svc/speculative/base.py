"""The proposer interface of speculative decoding, and the per-request rule for how many drafts
to ask for (k). Torch-free: proposers read token ids only.

A proposer names up to k tokens it guesses follow a request's tokens (prompt and output so
far); the worker verifies them all in one forward pass (worker_svc.sampling.speculative), so a
wrong guess costs its budget tokens and nothing else. A proposer keeps whatever per-request
state it wants in Request.spec_state under its own name (it goes away with the request).

How many drafts a request gets (`Speculator.k_for`), from its recent acceptance: with draft i
accepted with probability alpha^i (each accepted with probability alpha given the ones before),
the i-th draft is worth proposing only while alpha^i >= `min_gain`. alpha is estimated by the
geometric-law estimate accepted / (accepted + rejections) over sums that decay by 0.8 a step
(so it follows the last five to ten verification steps), from a prior of one accepted and one
rejected draft (alpha = 0.5).
The sums decay at every verification step and, more slowly, at every decode without drafts, so a
request whose drafts stopped being accepted (k = 0) is tried again after a while. How many of
those drafts are scheduled is the policy's budget rule (scheduler_svc.policies.base).
"""
from __future__ import annotations

import math
from typing import Protocol

from scheduler_svc.request import Request


class Proposer(Protocol):
    """name: the --speculative choice. propose(): at most k (>= 1) draft token ids for the
    positions after req.token_ids; fewer (or none) when it has no good guess. A proposer may
    also define finish(req), called when a request ends."""

    name: str

    def propose(self, req: Request, k: int) -> list[int]: ...


class Speculator:
    """A proposer plus the per-request k rule (module doc) and the counters of proposed and
    accepted drafts. max_k: the upper bound (--num-speculative-tokens)."""

    def __init__(self, proposer: Proposer, max_k: int, *, min_gain: float = 0.25,
                 decay: float = 0.8, idle_decay: float = 0.98):
        if max_k < 1:
            raise ValueError(f"the number of speculative tokens must be >= 1, got {max_k}")
        self.proposer = proposer
        self.max_k = max_k
        self.min_gain = min_gain
        self.decay, self.idle_decay = decay, idle_decay
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

    def k_for(self, req: Request) -> int:
        """Drafts worth asking for, from the request's acceptance (module doc), capped by max_k
        and by the tokens it may still generate (one of which is the token after the drafts)."""
        left = req.sampling.max_tokens - req.num_output_tokens - 1
        if left <= 0:
            return 0
        alpha = self.acceptance(req)
        if alpha <= self.min_gain:
            k = 0
        elif alpha >= 1.0:
            k = self.max_k
        else:
            k = int(math.log(self.min_gain) / math.log(alpha))
        return min(k, self.max_k, left)

    def propose(self, req: Request, k: int) -> list[int]:
        return self.proposer.propose(req, k)[:k] if k > 0 else []

    def finish(self, req: Request) -> None:
        """req ended (any reason): a proposer that learns from outputs sees it."""
        finish = getattr(self.proposer, "finish", None)
        if finish is not None:
            finish(req)

    def no_draft(self, req: Request) -> None:
        """req decodes this step without drafts: its evidence ages a little."""
        st = self._sums(req)
        st[0] = 1.0 + (st[0] - 1.0) * self.idle_decay
        st[1] = 1.0 + (st[1] - 1.0) * self.idle_decay

    def observe(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """A verification step of req: num_accepted of its num_drafts drafts were accepted."""
        st = self._sums(req)
        st[0] = st[0] * self.decay + num_accepted
        st[1] = st[1] * self.decay + (1 if num_accepted < num_drafts else 0)
        self.proposed += num_drafts
        self.accepted += num_accepted
        self.steps += 1
        self.emitted += num_accepted + 1

    def stats(self) -> dict:
        """spec_proposed_tokens, spec_accepted_tokens (since start), spec_acceptance_rate
        (accepted / proposed), spec_tokens_per_step (tokens per verification step)."""
        return dict(spec_proposed_tokens=self.proposed, spec_accepted_tokens=self.accepted,
                    spec_acceptance_rate=self.accepted / self.proposed if self.proposed else 0.0,
                    spec_tokens_per_step=self.emitted / self.steps if self.steps else 0.0)
