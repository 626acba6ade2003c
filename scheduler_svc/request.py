"""One request as the scheduler sees it: tokens, progress, KV blocks, status, timestamps.

The whole scheduling model is one invariant (vLLM v1 style):

    0 <= num_computed_tokens <= num_tokens = len(prompt_token_ids) + len(output_token_ids)

num_computed_tokens counts tokens whose K/V are in the KV cache (or are being written by the
batch in flight: it advances when a batch is *scheduled*). A policy hands out tokens so that
computed catches up with total; when it does, a new token is sampled and total grows by one.
A prefill chunk, a decode and the re-prefill of a preempted request are all the same move.
With async scheduling a decode may be scheduled before the token it computes is known (the
previous batch is still running): num_computed_tokens is then num_tokens + 1 until that token
comes back (`is_ahead`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # in the waiting queue, no KV blocks
    RUNNING = "running"        # admitted: holds KV blocks (for every token scheduled so far)
    PREEMPTED = "preempted"    # back at the head of the waiting queue, blocks freed, to recompute
    FINISHED = "finished"      # finish_reason says why: stop | length | abort | error


FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(eq=False, slots=True)
class Request:
    """A request's scheduling state. Times are seconds on the scheduler's injected clock."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)   # prompt + generated, in order
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    block_table: list[int] = field(default_factory=list)  # physical KV block ids, logical order
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    num_cached_blocks: int = 0      # leading blocks registered in (or taken from) the prefix cache
    in_flight: int = 0              # scheduled batches holding a chunk of it, output not back (0-2)
    num_preemptions: int = 0
    num_prompt_tokens: int = 0      # len(prompt_token_ids), cached: read in every iteration
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    finish_time: float | None = None
    share_prompt_with: str | None = None  # a sibling (same prompt) whose prompt KV to share
    logprobs: list | None = None    # per generated token [logprob, top ids, top logprobs], if asked
    # speculative decoding: draft tokens of the batch in flight (not tokens of the request: they
    # become tokens only as the worker accepts them), and the proposer's per-request state
    draft_token_ids: list[int] = field(default_factory=list)
    spec_state: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    # -- token counts (tokens) -----------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_new_tokens(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """True when the only token left to compute is the last sampled one."""
        n = len(self.token_ids)
        return n - self.num_computed_tokens == 1 and n > self.num_prompt_tokens

    @property
    def is_ahead(self) -> bool:
        """A decode was scheduled ahead: the token it computes has not come back yet."""
        return self.num_computed_tokens > len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    # -- metrics (seconds) ---------------------------------------------------------------------
    @property
    def ttft(self) -> float | None:
        """Time to first token: first token time minus arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def scheduling_delay(self) -> float | None:
        """First time scheduled minus arrival."""
        t = self.first_scheduled_time
        return None if t is None else t - self.arrival_time

    @property
    def tbts(self) -> list[float]:
        """Gaps between consecutive tokens; the first token is not a sample."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]
