"""Sampling parameters of one request: validated once, at the edge, then trusted everywhere.

Torch-free: the gateway, the scheduler and the worker all import this module.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


class InvalidRequestError(ValueError):
    """A request that can never be served as asked. `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    """How to pick each new token of one request.

    temperature: 0 means greedy (argmax); > 0 scales logits before softmax.
    top_k: keep the k most likely tokens; -1 (or 0) disables.
    top_p: keep the smallest set of tokens whose probability mass reaches top_p; 1.0 disables.
    max_tokens: number of tokens to generate at most (>= 1).
    seed: makes sampling reproducible per request: token i is drawn with a generator seeded by
        (seed, i), so a recomputed (preempted or replayed) request draws the same tokens.
    stop_token_ids: generation ends (finish_reason "stop") when one of these is sampled.
    ignore_eos: keep generating past the model's EOS tokens (benchmarks use this).
    presence_penalty, frequency_penalty: in [-2, 2], OpenAI's: subtracted from the logit of every
        token already generated, once (presence) and once per occurrence (frequency).
    repetition_penalty: > 0, 1.0 disables (the CTRL / Hugging Face rule, as vLLM): a logit of a
        token seen in the prompt or the output is divided by it when positive, multiplied when
        negative.
    min_tokens: EOS and stop_token_ids cannot be sampled before this many tokens were generated.
    logprobs: None = none; k >= 0 = return the sampled token's log-probability and the k most
        likely alternatives (at most MAX_LOGPROBS). They are the log-softmax of the logits the
        token is drawn from: after penalties and temperature, before top-k / top-p (see
        worker_svc.sampling). With a constraint, of the constrained distribution (tokens the
        grammar forbids have probability 0: logprob -inf, reported as -9999.0).
    logit_bias: (token id, bias in [-100, 100]) pairs added to the logits after penalties
        (OpenAI's: -100 bans a token, +100 all but forces it). Ids past the logits' width are
        ignored by the worker (the gateway refuses ids outside the vocabulary).
    constraint: None, or an llguidance grammar (JSON text, shared.constraints.grammar_for) the
        output must match: the worker masks every token the grammar forbids at each step, and
        lets only EOS through once the grammar is complete (finish_reason "stop").
    speculative: False opts this request out of speculative decoding (no draft tokens are
        scheduled for it); True lets the server speculate when it is configured to.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    constraint: str | None = None
    speculative: bool = True

    def __post_init__(self) -> None:
        # the wire (msgpack / JSON) turns tuples into lists: one shape on every side
        self.logit_bias = [tuple(b) for b in self.logit_bias]
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first out-of-range field."""
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature!r}", "temperature")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}", "top_k")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers", "stop_token_ids")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {v!r}", name)
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}",
                                      "repetition_penalty")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                                      f"got {self.min_tokens!r}", "min_tokens")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
                                      "logprobs")
        for b in self.logit_bias:
            if len(b) != 2 or not _is_int(b[0]) or b[0] < 0 or not _is_number(b[1]) or not -100 <= b[1] <= 100:
                raise InvalidRequestError("logit_bias maps token ids (>= 0) to biases in [-100, 100], "
                                          f"got {b!r}", "logit_bias")
        if not isinstance(self.speculative, bool):
            raise InvalidRequestError(f"speculative must be true or false, got {self.speculative!r}",
                                      "speculative")
        if self.constraint is not None:
            if not isinstance(self.constraint, str):
                raise InvalidRequestError("constraint must be a grammar string", "constraint")
            # a complete grammar lets only EOS through: nothing may hold EOS back
            for name in ("ignore_eos", "min_tokens"):
                if getattr(self, name):
                    raise InvalidRequestError(f"{name} cannot be combined with an output constraint", name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when sampling depends on the tokens before (the worker then tracks them)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def reads_history(self) -> bool:
        """True when sampling reads the tokens before (penalties, or a constraint: the worker
        keeps the request's token history and rebuilds its grammar matcher from it), so a
        worker new to the request must be sent them (SeqChunk.prior_token_ids)."""
        return self.has_penalties or self.constraint is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        return cls(**d)


MAX_LOGPROBS = 20  # top alternatives per token, at most (OpenAI's top_logprobs limit)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def step_seed(seed: int, output_index: int) -> int:
    """The generator seed for the `output_index`-th generated token of a request seeded `seed`.

    Stateless so that sampling is reproducible across preemption, replay and worker restarts.
    """
    return (seed * 1_000_003 + output_index * 7_919 + 0x5EED) % (2**63 - 1)
