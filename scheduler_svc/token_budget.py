"""An adaptive token budget: tau set online from observed iteration times against a TBT SLO, so a
user gives the SLO instead of a budget (`--token-budget adaptive --tbt-slo S`). Torch-free; the
same code runs in the real scheduler and in simulation (it reads only the scheduler's clock).

Why this rule. An iteration of T tokens costs about a + b*T, where a (fixed costs, the decodes'
KV reads) and b (per-token linear and prefill-attention cost) drift with the workload: longer
prompts make later chunks attend to longer prefixes (b grows), more decodes raise a. A batch that
used the whole budget (T >= `full` x tau) took t seconds; scaling tau by target / t is a step of
the fixed-point iteration tau <- tau x target / (a/tau + b) / tau, whose fixed point is exactly
a + b * tau = target, without estimating a and b apart. Steps are damped (square root of the
ratio) and capped to x2 / /2. A batch that did not fill the budget says nothing about a full one,
unless it was already too slow: then tau drops at once to what would have fitted.

Invariants: tau is a multiple of `tile` tokens in [tile, max_tau]; target = headroom x SLO
(headroom < 1 leaves room for batch-to-batch variation, since TBT is judged at its P99).
"""
from __future__ import annotations

import math


class AdaptiveTokenBudget:
    """observe(num_tokens, seconds, now) after each batch; `tau` is the budget to use next.

    slo_s: the P99 TBT SLO (s). tile: tau's granularity (tokens). max_tau: upper bound (tokens).
    initial: the first tau (tokens, clamped). history: (now, tau) at every change, for results."""

    def __init__(self, slo_s: float, *, tile: int = 32, max_tau: int = 4096, initial: int = 512,
                 headroom: float = 0.85, full: float = 0.9):
        if not slo_s > 0:
            raise ValueError(f"the TBT SLO must be > 0 s, got {slo_s}")
        if tile < 1 or max_tau < tile:
            raise ValueError(f"need 1 <= tile <= max_tau, got tile {tile}, max_tau {max_tau}")
        self.slo_s, self.tile, self.headroom, self.full = slo_s, tile, headroom, full
        self.max_tau = max_tau - max_tau % tile
        self.target_s = headroom * slo_s
        self._tau_f = float(min(max(initial, tile), self.max_tau))
        self.tau = self._aligned()
        self.history: list[tuple[float, int]] = [(0.0, self.tau)]

    def _aligned(self) -> int:
        return int(min(self.max_tau, max(self.tile, math.floor(self._tau_f / self.tile) * self.tile)))

    def observe(self, num_tokens: int, seconds: float, now: float = 0.0) -> None:
        """A batch of num_tokens tokens took `seconds` from scheduling to its tokens."""
        if seconds <= 0 or num_tokens <= 0:
            return
        ratio = self.target_s / seconds
        if num_tokens >= self.full * self.tau:
            self._tau_f *= min(2.0, max(0.5, math.sqrt(ratio)))
        elif ratio < 1:   # too slow although not full: what would have fitted, at once
            self._tau_f = min(self._tau_f, num_tokens * ratio)
        else:
            return
        self._tau_f = min(max(self._tau_f, self.tile), self.max_tau)
        tau = self._aligned()
        if tau != self.tau:
            self.tau = tau
            self.history.append((now, tau))
