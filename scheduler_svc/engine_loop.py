"""The engine loop: schedule -> submit (up to `depth` batches in flight) -> collect the oldest ->
update, one collected batch per step().

With pp pipeline stages one batch occupies one stage at a time; to keep every stage busy the loop
keeps up to `depth` (= pp) batches in flight and plans the next one while the earlier ones run.
A single worker is depth 1: schedule, run, update; with async scheduling
(SchedulerConfig.async_scheduling) it keeps one batch more in flight, planned ahead while the
one before runs (Scheduler.schedule(ahead=True)), so the worker finds its next batch waiting.
Each step():

1. fills: schedule() and submit() until `depth` batches are in flight or the policy has nothing
   more to run (requests already in flight are invisible to the policy: a request is in at most
   one in-flight batch; the scheduler's counters advance at schedule time);
2. collects the oldest batch (outputs come back in submit order) and hands it to update(), so a
   finished batch's tokens are in the request's state before that request can be scheduled again.

Batches are a deterministic function of the arrivals and the order of schedule/update calls, not
of timing: with the same depth, an in-process executor makes the very same batches as remote
ranks, which is what the parallel tests compare.

The executor is injected. The scheduler's executors are one family: Executor (this module's
protocol: `execute(batch) -> BatchOutput`; the worker's ModelRunner in process,
sim_executor.SimExecutor), which the loop runs when a batch is collected, and PipelineExecutor
(`submit(batch)` and `collect() -> (batch, output)`; remote_executor.RemoteExecutor, a client of
remote workers). With async scheduling an executor that also has `launch(batch)` and
`finish(handle)` (the ModelRunner) is launched when a batch is submitted and finished when it
is collected. Nothing here imports torch.

An EngineLoop is an engine (scheduler_svc.engine): the scheduler service runs it for one worker
or replica, with the fault rules of the "worker faults" methods below (a lost worker's requests
are preempted and held until it answers, or fail after restart_timeout_s). Offline generate()
and PoolSet (which drives one loop per pool and handles its workers' faults itself) use none of
those methods.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler
from shared.messages import Batch, BatchOutput, TokenEvent
from shared.sampling import SamplingParams

log = logging.getLogger("sarathi.scheduler")


class Executor(Protocol):
    def execute(self, batch: Batch) -> BatchOutput: ...


class PipelineExecutor(Protocol):
    def submit(self, batch: Batch) -> None: ...

    def collect(self) -> tuple[Batch, BatchOutput]: ...


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


class _ExecuteOnCollect:
    """submit/collect over an executor with only execute(batch): the oldest submitted batch runs
    when it is collected. The reference that remote pipelines are compared with."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self._queue: deque[Batch] = deque()

    def submit(self, batch: Batch) -> None:
        self._queue.append(batch)

    def collect(self) -> tuple[Batch, BatchOutput]:
        batch = self._queue.popleft()
        return batch, self.executor.execute(batch)

    def abandon(self) -> None:
        self._queue.clear()


class _LaunchOnSubmit:
    """submit/collect over an executor with launch(batch) -> handle and finish(handle) ->
    BatchOutput (the model runner in process): a batch is launched when submitted and finished
    when collected, so with async scheduling batch n + 1 is launched before batch n's tokens are
    read back (on a GPU it is queued behind batch n while the host goes on)."""

    def __init__(self, executor):
        self.executor = executor
        self._queue: deque = deque()

    def submit(self, batch: Batch) -> None:
        self._queue.append((batch, self.executor.launch(batch)))

    def collect(self) -> tuple[Batch, BatchOutput]:
        batch, run = self._queue.popleft()
        return batch, self.executor.finish(run)

    def abandon(self) -> None:
        self._queue.clear()


class EngineLoop:
    """schedule -> submit (up to depth in flight) -> collect oldest -> update, per step().

    executor: see the module doc; `self.executor` is the object given. depth: batches in flight
    at most (>= 1). on_batch(batch, output, seconds): called for every collected batch, before
    update (metrics; seconds from submit to collect). record: keep `trace`, one dict per batch
    (batch_id, req_ids, num_tokens, waiting requests and in-flight batch ids at submit,
    submit/collect times on time.time(), the output's timings) for tests and benchmarks.
    before_submit(batch): called for every scheduled batch just before it is sent (the
    disaggregation coordinator adds its kv_sends there). restart_timeout_s: seconds the requests
    of a lost worker wait for it (service only); on_worker_lost(): called when the worker is
    lost or restarted (metrics).
    """

    def __init__(self, scheduler: Scheduler, executor: Executor | PipelineExecutor, depth: int = 1,
                 on_batch: Callable[[Batch, BatchOutput, float], None] | None = None,
                 record: bool = False, before_submit: Callable[[Batch], None] | None = None,
                 restart_timeout_s: float = 30.0, on_worker_lost: Callable[[], None] | None = None):
        if depth < 1:
            raise ValueError(f"pipeline depth must be >= 1, got {depth}")
        self.ahead = scheduler.config.async_scheduling   # one batch planned ahead of the running one
        if self.ahead and depth > 1:
            raise ValueError("async scheduling needs one pipeline stage: with pipeline parallelism "
                             "the stages already overlap consecutive batches")
        self.scheduler = scheduler
        self.executor = executor
        if hasattr(executor, "submit"):
            self._pipe = executor
        elif self.ahead and hasattr(executor, "launch"):
            self._pipe = _LaunchOnSubmit(executor)
        else:
            self._pipe = _ExecuteOnCollect(executor)
        self.depth = depth
        self.on_batch = on_batch
        self.in_flight: deque[Batch] = deque()   # submitted, not yet collected; oldest first
        self._submitted: dict[int, float] = {}   # batch_id -> perf_counter() at submit
        self.record = record
        self.trace: list[dict] = []
        self._ids = itertools.count()
        self.before_submit = before_submit   # may add to a batch before it is sent (kv_sends)
        self.restart_timeout_s = restart_timeout_s
        self.on_worker_lost = on_worker_lost
        self.worker_down_since: float | None = None   # time.monotonic() when the worker was lost
        self._last_collect = 0.0                 # perf_counter() at the last collect

    # -- the engine interface (scheduler_svc.engine) ---------------------------------------------
    def add_request(self, req_id: str, prompt_token_ids: list[int],
                    sampling: SamplingParams | None = None,
                    arrival_time: float | None = None, share_prompt_with: str | None = None) -> Request:
        return self.scheduler.add_request(req_id, prompt_token_ids, sampling, arrival_time, share_prompt_with)

    def abort(self, req_id: str, error: str | None = None) -> None:
        """Any moment, any thread: the request ends ("abort", or "error" with `error`) at the
        next step boundary."""
        self.scheduler.abort(req_id, error)

    def has_unfinished(self) -> bool:
        """Some request has not ended, or a batch is still in flight (async scheduling can leave
        one, planned ahead of a request's last token: collected like any other)."""
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    def stats(self) -> dict:
        return self.scheduler.stats()

    @property
    def clock(self) -> Callable[[], float]:
        return self.scheduler.clock

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.config.max_num_seqs

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def step(self) -> list[TokenEvent]:
        """Fill, then wait for the oldest batch; its token events (and those of aborts since the
        last step). Raises StalledError when requests are unfinished but nothing can run."""
        self.fill()
        if not self.in_flight:
            events = self.scheduler.take_events()
            if not events and self.scheduler.has_unfinished():
                raise StalledError(f"nothing schedulable; stats: {self.scheduler.stats()}")
            return events
        return self.collect_one()[2]

    def head_ready(self) -> bool:
        """True when collect_one() would not block for long: the oldest batch's output is back
        (or its executor has news that ends the wait: a lost link, a timeout). An executor without
        the hook (in-process: it runs the batch when collected) is always ready."""
        if not self.in_flight:
            return False
        ready = getattr(self._pipe, "head_ready", None)
        return True if ready is None else ready()

    def collect_one(self) -> tuple[Batch, BatchOutput, list[TokenEvent]]:
        """Collect the oldest batch in flight and update the scheduler with it: (batch, its
        output, the token events of this step)."""
        batch, output = self._pipe.collect()
        if batch is not self.in_flight[0]:
            raise RuntimeError(f"collected batch {batch.batch_id}, expected the oldest "
                               f"{self.in_flight[0].batch_id}")
        self.in_flight.popleft()
        now = time.perf_counter()
        started = self._submitted.pop(batch.batch_id)
        if self.ahead:   # planned ahead: it started when the batch before it ended
            started = max(started, self._last_collect)
        seconds, self._last_collect = now - started, now
        if self.record:
            entry = next(e for e in reversed(self.trace) if e["batch_id"] == batch.batch_id)
            entry.update(collected_at=time.time(), timings=dict(output.timings))
        if self.on_batch is not None:
            self.on_batch(batch, output, seconds)
        return batch, output, self.scheduler.update(batch, output)

    def fill(self) -> None:
        """Schedule and submit until `depth` batches are in flight (one more with async
        scheduling, while the scheduler allows it) or nothing more can run."""
        while len(self.in_flight) < self.depth + self.ahead:
            ahead = len(self.in_flight) == self.depth   # only with self.ahead
            if ahead and not self.scheduler.can_schedule_ahead():
                return
            batch = self.scheduler.schedule(ahead=True) if ahead else self.scheduler.schedule()
            if batch is None:
                return
            if self.in_flight and not ahead:   # the scheduler's invariant; a breach corrupts KV silently
                busy = {s.req_id for b in self.in_flight for s in b.seqs}
                both = busy & {s.req_id for s in batch.seqs}
                if both:
                    raise RuntimeError(f"requests {sorted(both)[:5]} would be in two batches in flight")
            if self.record:
                self.trace.append(dict(batch_id=batch.batch_id, req_ids=[s.req_id for s in batch.seqs],
                                       num_tokens=batch.num_tokens,
                                       waiting=len(self.scheduler.waiting),
                                       in_flight=[b.batch_id for b in self.in_flight],
                                       submitted_at=time.time()))
            if self.before_submit is not None:
                self.before_submit(batch)
            self._submitted[batch.batch_id] = time.perf_counter()
            self._pipe.submit(batch)
            self.in_flight.append(batch)

    def take_events(self) -> list[TokenEvent]:
        """Events produced outside a step (aborts taken when fill() scheduled), for the caller
        that fills between steps (the scheduler service)."""
        return self.scheduler.take_events()

    def take_in_flight(self) -> list[Batch]:
        """Forget the batches in flight (their outputs will never come: a worker failed) and
        return them, oldest first. The executor forgets them too, where it can (`abandon()`)."""
        lost, self.in_flight = list(self.in_flight), deque()
        self._submitted.clear()
        abandon = getattr(self._pipe, "abandon", None)
        if abandon is not None:
            abandon()
        return lost

    # -- worker faults (the scheduler service; see scheduler_svc.engine) ----------------------------
    @property
    def worker_up(self) -> bool:
        return self.worker_down_since is None

    def has_work(self) -> bool:
        return self.worker_up and self.has_unfinished()

    def check_worker(self) -> bool:
        """A link that went down while idle counts as a lost worker. False while it is lost."""
        check = getattr(self.executor, "check_links", None)
        lost = check() if check is not None else []
        if lost and self.worker_up:
            self._worker_lost(f"worker {', '.join(lost)} disconnected")
        return self.worker_up

    def wait_for_worker(self) -> list[TokenEvent]:
        """Wait up to 0.5 s for the lost worker to answer (then the held requests run on it);
        past restart_timeout_s every request ends with an "error" event (returned)."""
        from scheduler_svc.remote_executor import WorkerError  # here: offline use loads no zmq

        wait = getattr(self.executor, "wait_ready", None)
        try:
            if wait is not None:
                wait(0.5)
            log.info("a worker answers again; replaying %d requests", len(self.scheduler.requests))
            self.worker_down_since = None
            return []
        except WorkerError:
            pass
        down_s = time.monotonic() - self.worker_down_since
        if down_s > self.restart_timeout_s and self.scheduler.has_unfinished():
            message = (f"no worker answered for {down_s:.0f} s "
                       f"(worker_restart_timeout_s={self.restart_timeout_s:g})")
            log.error("%s; failing %d requests", message, len(self.scheduler.requests))
            for req_id in list(self.scheduler.requests):
                self.scheduler.abort(req_id, error=message)
            return self.scheduler.apply_aborts()
        return []

    def recover(self, error: Exception) -> list[TokenEvent]:
        """After step() raised `error`. A lost worker (WorkerLostError; a TP/PP rank included):
        every request is preempted and held until a worker answers. A restarted one: the same,
        and it runs them at once. A failed iteration (WorkerError): the requests of the batches in
        flight end with an "error" event. Anything else (a bug): every request ends so."""
        from scheduler_svc.remote_executor import WorkerError, WorkerLostError, WorkerRestartedError

        if isinstance(error, WorkerLostError):
            self._worker_lost(str(error))
        elif isinstance(error, WorkerRestartedError):
            log.error("%s; replaying %d requests on it", error, len(self.scheduler.requests))
            if self.on_worker_lost is not None:
                self.on_worker_lost()
            self._replay_all()
        elif isinstance(error, WorkerError):
            log.error("iteration failed: %s", error)
            self._fail_in_flight(f"the worker failed this request's iteration: {error}", [])
        else:   # a bug must not leave requests hanging: fail them, keep serving
            log.error("engine step failed", exc_info=error)
            self._fail_in_flight(f"internal error: {type(error).__name__}: {error}",
                                 list(self.scheduler.requests))
        return self.scheduler.take_events()

    def _worker_lost(self, message: str) -> None:
        """The worker's KV is gone: preempt every running request (it is recomputed, with its
        generated tokens, once a worker answers) and stop running until then."""
        log.error("%s; holding %d requests for up to %.0f s until a worker answers", message,
                  len(self.scheduler.requests), self.restart_timeout_s)
        if self.on_worker_lost is not None:
            self.on_worker_lost()
        self._replay_all()
        self.worker_down_since = time.monotonic()

    def _replay_all(self) -> None:
        self.take_in_flight()   # the batches in flight will never be answered
        self.scheduler.on_workers_lost()

    def _fail_in_flight(self, message: str, also_fail: list[str]) -> None:
        """After a failed step no batch in flight will be answered (the executor dropped them
        all), so no request may stay marked in flight (aborts wait for that mark to clear). The
        requests of the lost batches, and `also_fail`, end with an "error" event at the next step
        boundary."""
        for lost in self.take_in_flight():
            self.scheduler.fail_batch(lost, message)
        self.scheduler.on_batches_abandoned()
        for req_id in also_fail:
            self.scheduler.abort(req_id, error=message)

    # -- offline ----------------------------------------------------------------------------------
    def run_until_done(self, on_event: Callable[[TokenEvent], None] | None = None,
                       max_steps: int | None = None) -> int:
        """Step until no request is unfinished; returns the number of steps taken."""
        steps = 0
        while self.has_unfinished() and (max_steps is None or steps < max_steps):
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
