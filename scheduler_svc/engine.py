"""The engine interface: what one SchedulerService (scheduler_svc.service) drives.

Two engines implement it: EngineLoop (scheduler_svc.engine_loop: one Scheduler over one worker or
one TP x PP replica) and PoolSet (scheduler_svc.pools: several worker pools under one scheduler,
colocated or prefill/decode). The offline API (sarathi.llm) and the simulator drive an EngineLoop
through the first part of it too.

Requests and iterations:
* add_request() queues a request, or raises InvalidRequestError before anything is queued;
* abort() ends a request at the next step boundary ("abort", or "error" with `error`), from any
  thread; unknown ids are ignored;
* step() runs one iteration and returns its TokenEvents, in the order they happened;
* has_unfinished(): some request has not ended yet (it may be waiting for a worker);
* stats(): the counters the service publishes (Scheduler.stats's keys, summed over pools; a
  PoolSet adds "pools", one dict per pool);
* clock: the scheduler's clock, a callable (seconds; arrival times are on it); admission room from
  max_num_seqs, num_waiting and num_running (requests).

Worker faults, for the service only (each engine applies its own rules; the service only calls):
* worker_up: a worker can run a batch (a PoolSet: any pool's);
* check_worker(): between steps, notice a lost link; False: the service waits for the worker
  (wait_for_worker(), which may block briefly and returns the events of the requests that
  waited past the restart timeout) instead of stepping. A PoolSet never asks to wait: its own
  step() asks its lost workers back;
* has_work(): step() has something to do now (requests to run, or a PoolSet's lost workers to
  ask back);
* recover(error): step() raised `error`; what becomes of the requests it touched (preempted to
  be recomputed, ended with an "error" event); returns the events ready now.

Optional: fill() submits the next batch(es) now, without waiting for one, and take_events() returns
what that produced (aborts); EngineLoop has both. The service calls them right after a step, so
that the worker computes while the service publishes.
"""
from __future__ import annotations

from typing import Callable, Protocol

from scheduler_svc.request import Request
from shared.messages import TokenEvent
from shared.sampling import SamplingParams


class Engine(Protocol):
    """See the module doc."""

    def add_request(self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams | None = None,
                    arrival_time: float | None = None, share_prompt_with: str | None = None) -> Request: ...

    def abort(self, req_id: str, error: str | None = None) -> None: ...

    def step(self) -> list[TokenEvent]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> dict: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def worker_up(self) -> bool: ...

    def check_worker(self) -> bool: ...

    def wait_for_worker(self) -> list[TokenEvent]: ...

    def has_work(self) -> bool: ...

    def recover(self, error: Exception) -> list[TokenEvent]: ...
