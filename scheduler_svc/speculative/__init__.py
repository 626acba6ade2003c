"""Speculative decoding, the scheduler's side: proposers (one small module each) and the
per-request k rule (base.Speculator). The worker verifies the drafts
(worker_svc.sampling.speculative); the policies decide how many fit the budget
(scheduler_svc.policies.base.Policy.take_drafts).

Which requests get drafts (`eligible`): greedy requests, and sampled requests without a seed,
none of them with penalties or an output constraint, and not opted out
(SamplingParams.speculative False). Penalties and constraints make each position's
distribution depend on the tokens before it, drafts included; a seeded sampled request's tokens
must not depend on how many drafts the load allowed (a replay must draw the same tokens).
"""
from __future__ import annotations

from scheduler_svc.request import Request
from scheduler_svc.speculative.base import Proposer, Speculator
from scheduler_svc.speculative.ngram import NgramProposer
from shared.config import SchedulerConfig

SPECULATIVE_METHODS: tuple[str, ...] = ("off", "ngram", "suffix", "draft")
MAX_SPECULATIVE_TOKENS = 16   # the largest --num-speculative-tokens


def check_speculative(method: str, num_tokens: int) -> None:
    """Raise ValueError with a message for the user unless (method, num_tokens) can run."""
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"unknown speculative method {method!r}; choose one of "
                         f"{', '.join(SPECULATIVE_METHODS)}")
    if method == "off":
        return
    if not 1 <= num_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}] with "
                         f"--speculative {method}, got {num_tokens}")
    if method == "draft":
        raise ValueError("--speculative draft (a draft model) is not available in this version; "
                         "use ngram or suffix")


def make_speculator(config: SchedulerConfig) -> Speculator | None:
    """The speculator config.speculative names, or None for "off"; raises ValueError (see
    check_speculative) for a choice that cannot run."""
    check_speculative(config.speculative, config.num_speculative_tokens)
    if config.speculative == "off":
        return None
    if config.speculative == "suffix":
        from scheduler_svc.speculative.suffix import SuffixProposer
        proposer: Proposer = SuffixProposer()
    else:
        proposer = NgramProposer()
    return Speculator(proposer, config.num_speculative_tokens)


def eligible(req: Request) -> bool:
    """Whether req may be given drafts at all (module doc)."""
    p = req.sampling
    return (p.speculative and not p.reads_history
            and (p.greedy or p.seed is None))


__all__ = ["MAX_SPECULATIVE_TOKENS", "NgramProposer", "Proposer", "SPECULATIVE_METHODS", "Speculator",
           "check_speculative", "eligible", "make_speculator"]
