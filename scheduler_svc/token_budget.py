"""An adaptive token budget: tau set online from observed iteration times against a TBT SLO, so a
user gives the SLO instead of a budget (`--token-budget adaptive --tbt-slo S`). Torch-free; the
same code runs in the real scheduler and in simulation (it reads only the scheduler's clock).

Why this rule. An iteration of T tokens costs about a + b*T, where a (fixed costs, the decodes'
KV reads) and b (per-token linear and prefill-attention cost) drift with the workload: longer
prompts make later chunks attend to longer prefixes (b grows), more decodes raise a. A batch that
used the whole budget (T >= `full` x tau) took t seconds, t / T seconds per token; setting
tau = target / (t / T) is a step of the fixed-point iteration whose fixed point is exactly
a + b * tau = target, without estimating a and b apart. The per-token cost used is the *largest*
of the last `window` full batches: a prompt's later chunks attend to a longer prefix than its
first ones, so the recent worst case, not the last batch, is what the next chunks will cost (the
last batch alone lets tau grow on a prompt's cheap first chunks and overshoot on its tail). A
batch that did not fill the budget says nothing about a full one unless it was already too slow:
then tau drops at once to what would have fitted.

Invariants: tau is a multiple of `tile` tokens in [tile, max_tau]; target = headroom x SLO
(headroom < 1 leaves room for variation the window has not seen, since TBT is judged at its P99).
"""
from __future__ import annotations

import math
from collections import deque


class AdaptiveTokenBudget:
    """observe(num_tokens, seconds, now) after each batch; `tau` is the budget to use next.

    slo_s: the P99 TBT SLO (s). tile: tau's granularity (tokens). max_tau: upper bound (tokens).
    initial: the first tau (tokens, clamped). window: full batches remembered. history: (now, tau)
    at every change, for results."""

    def __init__(self, slo_s: float, *, tile: int = 32, max_tau: int = 4096, initial: int = 512,
                 headroom: float = 0.85, full: float = 0.9, window: int = 64):
        if not slo_s > 0:
            raise ValueError(f"the TBT SLO must be > 0 s, got {slo_s}")
        if tile < 1 or max_tau < tile:
            raise ValueError(f"need 1 <= tile <= max_tau, got tile {tile}, max_tau {max_tau}")
        self.slo_s, self.tile, self.headroom, self.full = slo_s, tile, headroom, full
        self.max_tau = max_tau - max_tau % tile
        self.target_s = headroom * slo_s
        self.per_token_s: deque[float] = deque(maxlen=window)   # t / T of recent full batches
        self.tau = self._aligned(initial)
        self.history: list[tuple[float, int]] = [(0.0, self.tau)]

    def _aligned(self, tokens: float) -> int:
        return int(min(self.max_tau, max(self.tile, math.floor(tokens / self.tile) * self.tile)))

    def observe(self, num_tokens: int, seconds: float, now: float = 0.0) -> None:
        """A batch of num_tokens tokens took `seconds` from scheduling to its tokens."""
        if seconds <= 0 or num_tokens <= 0:
            return
        if num_tokens >= self.full * self.tau:
            self.per_token_s.append(seconds / num_tokens)
            tau = self._aligned(self.target_s / max(self.per_token_s))
        elif seconds > self.target_s:   # too slow although not full: what would have fitted, at once
            tau = min(self.tau, self._aligned(num_tokens * self.target_s / seconds))
        else:
            return
        if tau != self.tau:
            self.tau = tau
            self.history.append((now, tau))
