"""The in-process engine loop: schedule -> execute -> update, one iteration per step().

The executor is injected: any object with `execute(batch: Batch) -> BatchOutput` (the torch
executor in worker_svc, a client of remote workers, or sim_executor.SimExecutor). Nothing here
imports torch.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler
from shared.messages import Batch, BatchOutput, TokenEvent
from shared.sampling import SamplingParams


class Executor(Protocol):
    def execute(self, batch: Batch) -> BatchOutput: ...


@dataclass
class GenerationOutput:
    """One finished request of generate(). Times in seconds on the scheduler's clock."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str | None
    error: str | None
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    token_times: list[float]
    num_preemptions: int
    logprobs: list | None = None  # per token [logprob, top ids, top logprobs] when asked

    @classmethod
    def from_request(cls, r: Request) -> "GenerationOutput":
        return cls(r.req_id, list(r.prompt_token_ids), r.output_token_ids, r.finish_reason,
                   r.error, r.arrival_time, r.first_scheduled_time, r.first_token_time,
                   list(r.token_times), r.num_preemptions, r.logprobs)


class StalledError(RuntimeError):
    """The scheduler has unfinished requests but can schedule nothing, with nothing in flight."""


class EngineLoop:
    def __init__(self, scheduler: Scheduler, executor: Executor):
        self.scheduler = scheduler
        self.executor = executor
        self._ids = itertools.count()

    def add_request(self, req_id: str, prompt_token_ids: list[int],
                    sampling: SamplingParams | None = None,
                    arrival_time: float | None = None) -> Request:
        return self.scheduler.add_request(req_id, prompt_token_ids, sampling, arrival_time)

    def abort(self, req_id: str) -> None:
        """Any moment, any thread: the request ends ("abort") at the next step boundary."""
        self.scheduler.abort(req_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[TokenEvent]:
        """One iteration; returns its token events (and those of aborts since the last step)."""
        batch = self.scheduler.schedule()
        if batch is None:
            events = self.scheduler.take_events()
            if not events and self.scheduler.has_unfinished():
                raise StalledError(f"nothing schedulable; stats: {self.scheduler.stats()}")
            return events
        return self.scheduler.update(batch, self.executor.execute(batch))

    def run_until_done(self, on_event: Callable[[TokenEvent], None] | None = None,
                       max_steps: int | None = None) -> int:
        """Step until no request is unfinished; returns the number of steps taken."""
        steps = 0
        while self.scheduler.has_unfinished() and (max_steps is None or steps < max_steps):
            for ev in self.step():
                if on_event is not None:
                    on_event(ev)
            steps += 1
        return steps

    def generate(self, prompts_token_ids: Sequence[list[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_event: Callable[[TokenEvent], None] | None = None) -> list[GenerationOutput]:
        """Offline batch generation: outputs in the order of the prompts. Raises
        InvalidRequestError (before running anything) if any request is invalid."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts_token_ids)
        if len(sampling) != len(prompts_token_ids):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = [f"gen-{next(self._ids)}" for _ in prompts_token_ids]
        for req_id, prompt, sp in zip(ids, prompts_token_ids, sampling):
            self.scheduler.validate_request(req_id, prompt, sp)  # all or nothing
        reqs = [self.add_request(i, p, sp) for i, p, sp in zip(ids, prompts_token_ids, sampling)]
        self.run_until_done(on_event)
        return [GenerationOutput.from_request(r) for r in reqs]
