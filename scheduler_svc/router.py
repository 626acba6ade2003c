"""Which worker pool a request runs on (prefill/decode disaggregation). Torch-free.

A pool is one worker (or one TP x PP replica) with its own Scheduler (scheduler_svc.pools.Pool);
its role is "mixed" (prefill and decode, as without disaggregation), "prefill" (prompts only:
the first token is sampled there, then the request's KV moves to a decode pool) or "decode"
(takes handed-off requests; also runs colocated requests with stall-free chunked prefill).

The rule, per new request (`Router.route`):

* mode "off": the least-loaded mixed/decode pool (colocated).
* mode "all": the prefill pool with the fewest queued prefill tokens (any up prefill pool).
* mode "auto": the prefill pool only when (1) the request's *uncached* prompt length on the
  decode pool it would otherwise run on (its prefix-cache hit there subtracted) is at least
  `threshold_tokens`, and (2) the prefill pool is not the bottleneck: its queued prefill
  tokens do not exceed the decode pool's by more than `backlog_margin_tokens`. Otherwise the
  request runs colocated on that decode pool. (2) sends long prompts to whichever side has the
  shorter prefill backlog once the prefill pool lags: without it a burst of long prompts would
  queue on the prefill worker while the decode worker's spare token budget stays unused.

A request that already has output tokens (recomputed after a lost worker or a failed transfer)
always runs colocated. When no pool of the wanted role is up, any up pool takes the request
(a prefill pool then also decodes); None only when no pool is up.

Load of a pool: its unfinished requests plus the handoffs reserved on it (ties: fewer used KV
blocks). Queued prefill tokens: prompt tokens not yet computed by requests that have no output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler_svc.request import Request

if TYPE_CHECKING:
    from scheduler_svc.pools import Pool

MODES = ("off", "all", "auto")
ROLES = ("mixed", "prefill", "decode")


@dataclass
class RouterConfig:
    """mode: off | all | auto (see the module doc). threshold_tokens: auto's minimum uncached
    prompt length (tokens) for disaggregation. backlog_margin_tokens: auto sends a long prompt
    colocated when the prefill pool's queued prefill tokens exceed the decode pool's by more."""

    mode: str = "off"
    threshold_tokens: int = 256
    backlog_margin_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"disaggregation mode must be one of {MODES}, not {self.mode!r}")
        if self.threshold_tokens < 0 or self.backlog_margin_tokens < 0:
            raise ValueError("disagg threshold and backlog margin must be >= 0 tokens")


def queued_prefill_tokens(pool: "Pool") -> int:
    """Prompt tokens not yet computed on `pool` (requests without output only)."""
    return sum(r.num_new_tokens for r in pool.scheduler.requests.values() if not r.num_output_tokens)


def load(pool: "Pool") -> tuple[int, int]:
    s = pool.scheduler
    return len(s.requests) + len(s.reserved), s.block_manager.num_used_blocks


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config

    def route(self, pools: list["Pool"], req: Request) -> "Pool | None":
        """The pool `req` is queued on (see the module doc); None when no pool is up."""
        up = [p for p in pools if p.up]
        if not up:
            return None
        colocated = self.colocated(up)
        mode = self.config.mode
        if mode == "off" or req.num_output_tokens:
            return colocated
        prefill = self.prefill_pool(up)
        if prefill is None:
            return colocated
        if mode == "all" or colocated is prefill:
            return prefill
        bm = colocated.scheduler.block_manager
        uncached = req.num_prompt_tokens - bm.cached_prefix_tokens(req)
        if uncached < self.config.threshold_tokens:
            return colocated
        if queued_prefill_tokens(prefill) > queued_prefill_tokens(colocated) + self.config.backlog_margin_tokens:
            return colocated   # the prefill pool is the bottleneck
        return prefill

    @staticmethod
    def colocated(up: list["Pool"]) -> "Pool":
        """The least-loaded up mixed/decode pool; any up pool when there is none."""
        cands = [p for p in up if p.role != "prefill"] or up
        return min(cands, key=load)

    @staticmethod
    def prefill_pool(up: list["Pool"]) -> "Pool | None":
        cands = [p for p in up if p.role == "prefill"]
        return min(cands, key=queued_prefill_tokens) if cands else None

    @staticmethod
    def decode_target(pools: list["Pool"], source: "Pool") -> "Pool | None":
        """Where a request prefilled on `source` decodes: the least-loaded up decode (or mixed)
        pool other than source that has a KV receiver; None when there is none."""
        cands = [p for p in pools if p.up and p is not source and p.role != "prefill"
                 and p.kv_address is not None]
        return min(cands, key=load) if cands else None
