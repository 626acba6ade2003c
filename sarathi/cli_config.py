"""The config objects (shared.config) that the `sarathi` subcommands build from their parsed
arguments (sarathi.cli): the worker's engine, the scheduler's policy and limits, and the token
budget they resolve. Shared by the serving commands (sarathi.commands) and the measurement ones
(sarathi.measure.commands), so each flag means one thing everywhere.
"""
from __future__ import annotations

import argparse
from typing import NamedTuple

from scheduler_svc.speculative import check_speculative
from shared.config import CacheConfig, SchedulerConfig, WorkerConfig, resolve_token_budget


def engine_config(a: argparse.Namespace) -> WorkerConfig:
    """The worker's engine (sarathi.cli's `_model_args`); what sizes graphs and the profiling pass
    is set by the caller from the scheduler's limits, or by `sarathi worker`'s own flags."""
    return WorkerConfig(model=a.model, dtype=a.dtype, device=a.device, num_threads=a.threads,
                        cache=CacheConfig(block_size=a.block_size, num_blocks=a.num_blocks),
                        gpu_memory_utilization=a.gpu_memory_utilization, cuda_graphs=a.cuda_graphs,
                        kv_cache_dtype=a.kv_cache_dtype, weight_quant=a.weight_quant)


class TokenBudget(NamedTuple):
    """--token-budget resolved: tau (tokens; where an adaptive budget starts) and the SLO (s) an
    adaptive budget follows (0.0: fixed)."""

    budget: int
    adaptive_slo: float


ADAPTIVE_START = 512   # tokens: where `--token-budget adaptive` starts (the controller moves it)


def token_budget(a: argparse.Namespace, slo: float | None = None) -> TokenBudget:
    """A number, a plan file, auto, or `adaptive` (needs an SLO: --tbt-slo, or `slo` given)."""
    if str(a.token_budget).strip() != "adaptive":
        return TokenBudget(resolve_token_budget(a.token_budget), 0.0)
    if a.policy != "sarathi":
        raise ValueError(f"--token-budget adaptive applies to the sarathi policy, not {a.policy}")
    slo = a.tbt_slo if a.tbt_slo > 0 else slo
    if not slo:
        raise ValueError("--token-budget adaptive needs the SLO to keep: --tbt-slo SECONDS")
    return TokenBudget(ADAPTIVE_START, slo)


def scheduler_config(a: argparse.Namespace, slo: float | None = None) -> SchedulerConfig:
    """The policy and its limits (sarathi.cli's `_sched_args`); tau from a number, a plan file or
    adaptive."""
    tau = token_budget(a, slo)
    speculative = getattr(a, "speculative", "off")
    num_spec = getattr(a, "num_speculative_tokens", 4)
    draft = getattr(a, "draft_model", None)
    check_speculative(speculative, num_spec, draft)   # a bad choice fails here, before any model loads
    if draft and speculative != "draft":
        raise ValueError("--draft-model applies only with --speculative draft")
    if speculative == "draft":
        enable_draft_model()
    return SchedulerConfig(policy=a.policy, token_budget=tau.budget, adaptive_tbt_slo_s=tau.adaptive_slo,
                           max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                           enable_prefix_caching=a.prefix_caching, speculative=speculative,
                           num_speculative_tokens=num_spec, draft_model=draft,
                           kv_events_config=getattr(a, "kv_events_config", None),
                           async_scheduling=getattr(a, "async_scheduling", False))


def enable_draft_model() -> None:
    """Let schedulers built in this process load a draft model (--speculative draft): the
    proposer runs the model with torch (worker_svc), which the scheduler's package never imports."""
    from scheduler_svc.speculative import register_proposer

    def factory(config: SchedulerConfig, model_info):
        from worker_svc.speculative.draft import DraftModelProposer
        return DraftModelProposer(config.draft_model, model_info)
    register_proposer("draft", factory)
