"""Speculative decoding, the scheduler's side: proposers (one small module each) and the
per-request k rule (base.Speculator). The worker verifies the drafts
(worker_svc.sampling.speculative); the policies decide how many fit the budget
(scheduler_svc.policies.base.Policy.take_drafts).

Which requests get drafts (`eligible`): greedy requests, and sampled requests without a seed,
none of them with penalties, and not opted out (SamplingParams.speculative False). Penalties
make each position's distribution depend on the counts of the tokens before it, drafts
included; a seeded sampled request's tokens must not depend on how many drafts the load allowed
(a replay must draw the same tokens). Requests with an output constraint do get drafts: the
worker masks each verified position by what the grammar allows after the drafts before it.
"""
from __future__ import annotations

from typing import Callable

from scheduler_svc.request import Request
from scheduler_svc.speculative.base import Proposer, Speculator
from scheduler_svc.speculative.ngram import NgramProposer
from shared.config import ModelInfo, SchedulerConfig

SPECULATIVE_METHODS: tuple[str, ...] = ("off", "ngram", "suffix", "draft")
MAX_SPECULATIVE_TOKENS = 16   # the largest --num-speculative-tokens


# proposers that need more than token ids (a draft model: torch) are registered by the process
# that can build them (the sarathi command), so this package stays torch-free:
# name -> factory(config, the served model's ModelInfo) -> Proposer
_FACTORIES: dict[str, Callable[[SchedulerConfig, ModelInfo | None], Proposer]] = {}


def register_proposer(name: str, factory: Callable[[SchedulerConfig, ModelInfo | None], Proposer]) -> None:
    """Make `name` buildable by make_speculator (the draft-model proposer: sarathi.cli_config)."""
    _FACTORIES[name] = factory


def check_speculative(method: str, num_tokens: int, draft_model: str | None = None) -> None:
    """Raise ValueError with a message for the user unless (method, num_tokens) can run."""
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"unknown speculative method {method!r}; choose one of "
                         f"{', '.join(SPECULATIVE_METHODS)}")
    if method == "off":
        return
    if not 1 <= num_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}] with "
                         f"--speculative {method}, got {num_tokens}")
    if method == "draft" and not draft_model:
        raise ValueError("--speculative draft needs --draft-model: a smaller model with the served "
                         "model's tokenizer")


def make_speculator(config: SchedulerConfig, model_info: ModelInfo | None = None) -> Speculator | None:
    """The speculator config.speculative names, or None for "off"; raises ValueError (see
    check_speculative; a draft model whose vocabulary is not the served model's) for a choice
    that cannot run. model_info: the served model's."""
    check_speculative(config.speculative, config.num_speculative_tokens, config.draft_model)
    if config.speculative == "off":
        return None
    if config.speculative == "draft":
        factory = _FACTORIES.get("draft")
        if factory is None:
            raise ValueError("--speculative draft: this process cannot load a draft model (start it "
                             "with the sarathi command)")
        proposer: Proposer = factory(config, model_info)
    elif config.speculative == "suffix":
        from scheduler_svc.speculative.suffix import SuffixProposer
        proposer = SuffixProposer()
    else:
        proposer = NgramProposer()
    return Speculator(proposer, config.num_speculative_tokens)


def eligible(req: Request) -> bool:
    """Whether req may be given drafts at all (module doc)."""
    p = req.sampling
    return (p.speculative and not p.has_penalties
            and (p.greedy or p.seed is None))


__all__ = ["MAX_SPECULATIVE_TOKENS", "NgramProposer", "Proposer", "SPECULATIVE_METHODS", "Speculator",
           "check_speculative", "eligible", "make_speculator", "register_proposer"]
