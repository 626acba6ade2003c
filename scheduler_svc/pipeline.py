"""Micro-batches in flight: the engine loop for a pipeline-parallel replica.

With pp stages, one batch occupies one stage at a time; to keep every stage busy the scheduler
keeps up to `depth` (= pp) batches in flight and plans the next one while the earlier ones run.
Each step():

1. fills the pipeline: schedule() and submit() until `depth` batches are in flight or the policy
   has nothing more to run (requests already in flight are invisible to the policy: a request is
   in at most one in-flight batch; the scheduler's counters advance at schedule time);
2. collects the oldest batch (outputs come back in submit order) and hands it to update(), so a
   finished micro-batch's tokens are in the request's state before that request can be scheduled
   again.

Batches are a deterministic function of the arrivals and the order of schedule/update calls, not
of timing: with the same depth, an in-process executor (SyncPipeline) makes the very same batches
as remote ranks, which is what the parallel tests compare. Torch-free.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Protocol

from scheduler_svc.engine_loop import StalledError
from scheduler_svc.scheduler import Scheduler
from shared.messages import Batch, BatchOutput, TokenEvent


class PipelineExecutor(Protocol):
    def submit(self, batch: Batch) -> None: ...

    def collect(self) -> tuple[Batch, BatchOutput]: ...


class SyncPipeline:
    """submit/collect over a synchronous executor (execute(batch) -> BatchOutput): runs the
    oldest batch when it is collected. The reference that remote pipelines are compared with."""

    def __init__(self, executor):
        self.executor = executor
        self._queue: deque[Batch] = deque()

    def submit(self, batch: Batch) -> None:
        self._queue.append(batch)

    def collect(self) -> tuple[Batch, BatchOutput]:
        batch = self._queue.popleft()
        return batch, self.executor.execute(batch)


class PipelinedLoop:
    """schedule -> submit (up to depth in flight) -> collect oldest -> update, per step().

    on_batch(batch, output, seconds): called for every collected batch (metrics; seconds from
    submit to collect). record: keep `trace`, one dict per batch (batch_id, req_ids, in-flight
    batch ids at submit, submit/collect times on time.time(), the output's timings) for tests
    and benchmarks."""

    def __init__(self, scheduler: Scheduler, executor: PipelineExecutor, depth: int,
                 on_batch: Callable[[Batch, BatchOutput, float], None] | None = None,
                 record: bool = False):
        if depth < 1:
            raise ValueError(f"pipeline depth must be >= 1, got {depth}")
        self.scheduler = scheduler
        self.executor = executor
        self.depth = depth
        self.on_batch = on_batch
        self.in_flight: deque[Batch] = deque()
        self._submitted: dict[int, float] = {}
        self.record = record
        self.trace: list[dict] = []

    def step(self) -> list[TokenEvent]:
        """Fill the pipeline, then wait for the oldest batch; its token events (and those of
        aborts since the last step)."""
        self.fill()
        if not self.in_flight:
            events = self.scheduler.take_events()
            if not events and self.scheduler.has_unfinished():
                raise StalledError(f"nothing schedulable; stats: {self.scheduler.stats()}")
            return events
        batch, output = self.executor.collect()
        if batch is not self.in_flight[0]:
            raise RuntimeError(f"collected batch {batch.batch_id}, expected the oldest "
                               f"{self.in_flight[0].batch_id}")
        self.in_flight.popleft()
        seconds = time.perf_counter() - self._submitted.pop(batch.batch_id)
        if self.record:
            entry = next(e for e in reversed(self.trace) if e["batch_id"] == batch.batch_id)
            entry.update(collected_at=time.time(), timings=dict(output.timings))
        if self.on_batch is not None:
            self.on_batch(batch, output, seconds)
        return self.scheduler.update(batch, output)

    def fill(self) -> None:
        while len(self.in_flight) < self.depth:
            batch = self.scheduler.schedule()
            if batch is None:
                return
            busy = {s.req_id for b in self.in_flight for s in b.seqs}
            both = busy & {s.req_id for s in batch.seqs}
            if both:   # the scheduler's invariant; checked because a breach corrupts KV silently
                raise RuntimeError(f"requests {sorted(both)[:5]} would be in two batches in flight")
            if self.record:
                self.trace.append(dict(batch_id=batch.batch_id, req_ids=[s.req_id for s in batch.seqs],
                                       num_tokens=batch.num_tokens,
                                       waiting=len(self.scheduler.waiting),
                                       in_flight=[b.batch_id for b in self.in_flight],
                                       submitted_at=time.time()))
            self._submitted[batch.batch_id] = time.perf_counter()
            self.executor.submit(batch)
            self.in_flight.append(batch)

    def take_in_flight(self) -> list[Batch]:
        """Forget the batches in flight (after a worker failure) and return them, oldest first."""
        lost, self.in_flight = list(self.in_flight), deque()
        self._submitted.clear()
        return lost

    def run_until_done(self, on_event: Callable[[TokenEvent], None] | None = None) -> int:
        """Step until no request is unfinished; returns the number of steps."""
        steps = 0
        while self.scheduler.has_unfinished():
            for ev in self.step():
                if on_event is not None:
                    on_event(ev)
            steps += 1
        return steps
