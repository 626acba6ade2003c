"""`sarathi simulate`: the unchanged scheduler (Scheduler + EngineLoop, every policy, PP
micro-batches in flight, preemption, prefix caching) against a simulated worker on a virtual
clock. Discrete-event: nothing sleeps; the clock jumps from one event to the next.

* SimulatedWorker: a pipeline of `stages` stages behind the EngineLoop's submit/collect seam.
  A submitted batch enters stage 0 when stage 0 is free, each later stage when the batch left
  the one before and that stage is free (stage times from the cost model: a GPUCostModel's
  stage_times, or one stage of a CPU CostModel); collect() moves the clock to the batch's end.
  Sampled tokens are a function of the position (runs ignore EOS: only lengths matter).
* Replicas: each replica is one scheduler + its worker with its own clock. Arrivals are routed
  when every busy replica's clock has reached them, to the replica with the fewest unfinished
  requests (ties: the lowest index), which approximates pull-based admission from the shared
  queue; the replica with the earliest clock steps next. A replica sees a request at its next
  iteration boundary, as the real scheduler does; with one replica this is run_inprocess.

Pipeline parallelism, two measures over stages and replicas:
* pp_idle_fraction: the share of stage time a stage is idle while its replica has unfinished
  requests (busy periods only): every bubble, including a pipeline the policy cannot fill (a policy
  that puts every decode in one micro-batch leaves the other stages waiting);
* pp_bubble_fraction: only the idle time between two batches where the stage waits for an earlier
  stage to hand over a batch that had already entered the pipeline (uneven micro-batch times), out
  of that time plus busy time.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable

import numpy as np

from sarathi.measure.costmodel import aggregates, batch_shapes
from sarathi.measure.loadgen import RequestSpec, RunResult, _record, bench_sampling
from sarathi.measure.metrics import IterationRecord, windowed_tbt_p99
from sarathi.measure.tools import Target
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sim_executor import SimClock
from shared.config import CacheConfig, ModelInfo, SchedulerConfig
from shared.messages import Batch, BatchOutput


class SimulatedWorker:
    """submit(batch) / collect() -> (batch, output): a pipelined worker on a SimClock.

    cost: an object with stage_times(batch) -> [seconds per stage] (GPUCostModel), or a callable
    batch -> seconds (one stage). noise_sigma > 0: each batch's times x exp(sigma z - sigma^2 / 2),
    z standard normal from a generator seeded with `seed` (mean 1; deterministic for a run).
    Keeps busy / bubble seconds per stage."""

    def __init__(self, cost, clock: SimClock, block_size: int, vocab_size: int,
                 noise_sigma: float = 0.0, seed: int = 0):
        self.cost, self.clock = cost, clock
        self.noise_sigma = noise_sigma
        self._rng = np.random.default_rng(seed)
        self.stage_times: Callable[[Batch], list[float]] = (
            cost.stage_times if hasattr(cost, "stage_times") else (lambda b: [cost(b)]))
        self.vocab_size = vocab_size
        self.stage_free: list[float] | None = None      # when each stage is next free (s)
        self.busy: list[float] = []
        self.bubble: list[float] = []
        self._queue: deque[tuple[Batch, float, list[float]]] = deque()

    def submit(self, batch: Batch) -> None:
        times = self.stage_times(batch)
        if self.noise_sigma > 0:   # iteration-to-iteration variation: lognormal, mean 1, seeded
            f = math.exp(self.noise_sigma * self._rng.standard_normal() - self.noise_sigma ** 2 / 2)
            times = [t * f for t in times]
        if self.stage_free is None:
            self.stage_free = [0.0] * len(times)
            self.busy, self.bubble = [0.0] * len(times), [0.0] * len(times)
        submitted = t = self.clock.now
        for s, dt in enumerate(times):
            start = max(t, self.stage_free[s])
            if s > 0 and self.stage_free[s] > submitted:
                # the stage finished its last batch after this one entered the pipeline and then
                # waited for an earlier stage to hand it over (pipeline fill after idle is not a bubble)
                self.bubble[s] += max(0.0, start - self.stage_free[s])
            t = start + dt
            self.stage_free[s] = t
            self.busy[s] += dt
        self._queue.append((batch, t, times))

    def collect(self) -> tuple[Batch, BatchOutput]:
        batch, done, times = self._queue.popleft()
        self.clock.now = max(self.clock.now, done)
        # the token is a function of the position only: outputs ignore EOS, so only lengths matter
        sampled = {s.req_id: 1 + (s.start_pos + len(s.token_ids)) % (self.vocab_size - 1)
                   for s in batch.seqs if s.sample}
        return batch, BatchOutput(batch.batch_id, sampled, {"forward_s": sum(times), "stages_s": times})

    def abandon(self) -> None:
        self._queue.clear()


class Replica:
    """One scheduler + its simulated worker, on its own SimClock."""

    def __init__(self, cost, sched_config: SchedulerConfig, *, block_size: int, num_blocks: int,
                 max_model_len: int, vocab_size: int = 32000, depth: int = 1, noise_sigma: float = 0.0,
                 seed: int = 0):
        self.clock = SimClock()
        self.scheduler = Scheduler(sched_config, CacheConfig(block_size=block_size, num_blocks=num_blocks),
                                   ModelInfo("sim", max_model_len, vocab_size, [0], block_size=block_size,
                                             num_blocks=num_blocks), clock=self.clock)
        self.worker = SimulatedWorker(cost, self.clock, block_size, vocab_size, noise_sigma, seed)
        self.engine = EngineLoop(self.scheduler, self.worker, depth=depth)
        self.busy_s = 0.0   # virtual seconds this replica had unfinished requests (s)

    @property
    def unfinished(self) -> int:
        return len(self.scheduler.requests)


def run_replicas(replicas: list[Replica], workload: list[RequestSpec], *, drain_s: float,
                 on_progress: Callable[[int], None] | None = None, windows: int = 0) -> tuple[RunResult, dict]:
    """Drive the replicas through the workload on virtual time (see the module doc). Returns the
    run (records of every request, iterations of every replica in start order) and extras:
    per-replica request counts and the pipeline bubble fraction."""
    end = (workload[-1].arrival if workload else 0.0) + drain_s
    pending = deque(sorted(workload, key=lambda s: s.arrival))
    reqs, iterations = {}, []
    last_batch: list[Batch] = []
    for r in replicas:
        r.engine.on_batch = lambda batch, output, seconds: last_batch.append(batch)
    routed = [0] * len(replicas)
    while True:
        busy = [r for r in replicas if r.scheduler.has_unfinished()]
        t_busy = min((r.clock.now for r in busy), default=float("inf"))
        t_arr = pending[0].arrival if pending else float("inf")
        if min(t_busy, t_arr) >= end:
            break
        if t_arr <= t_busy:
            spec = pending.popleft()
            i = min(range(len(replicas)), key=lambda k: (replicas[k].unfinished, k))
            r = replicas[i]
            routed[i] += 1
            r.clock.now = max(r.clock.now, spec.arrival)   # an idle replica wakes at the arrival
            reqs[spec.req_id] = (spec, r.engine.add_request(
                spec.req_id, spec.prompt_ids, bench_sampling(spec.max_tokens), spec.arrival))
            continue
        r = min(busy, key=lambda x: x.clock.now)
        started = r.clock.now
        last_batch.clear()
        events = r.engine.step()     # raises StalledError when nothing can ever run
        r.busy_s += r.clock.now - started
        done = sum(1 for e in events if e.finish_reason is not None)
        if done and on_progress:
            on_progress(done)
        if last_batch:
            batch = last_batch[0]
            tokens, kv, pairs, seqs = aggregates(batch_shapes(batch))
            decodes = sum(1 for s in batch.seqs if s.is_decode)
            iterations.append(IterationRecord(started, r.clock.now - started, tokens - decodes,
                                              decodes, seqs, kv, pairs))
    records = [_record(spec, 0.0, list(req.token_times), req.first_scheduled_time,
                       req.finish_reason in ("stop", "length"), req.error)
               for spec, req in reqs.values()]
    records += [_record(spec, 0.0, [], None, False, None) for spec in pending]
    busy_s = sum(sum(r.worker.busy) for r in replicas)
    bubble_s = sum(sum(r.worker.bubble) for r in replicas)
    stage_time = sum(len(r.worker.busy) * r.busy_s for r in replicas)
    extra = {"replica_requests": routed,
             "pp_bubble_fraction": bubble_s / (busy_s + bubble_s) if busy_s + bubble_s else 0.0,
             "pp_idle_fraction": max(0.0, 1 - busy_s / stage_time) if stage_time else 0.0,
             "stage_busy_s": [[round(b, 4) for b in r.worker.busy] for r in replicas]}
    iterations.sort(key=lambda it: it.start)
    end_time = max(r.clock.now for r in replicas)
    if windows:
        extra["windows"] = windowed_tbt_p99(records, 0.0, end_time, windows)
    adaptive = getattr(replicas[0].scheduler.policy, "adaptive", None)
    if adaptive is not None:   # tau over time (replica 0), at most ~1000 points
        h = adaptive.history
        extra["tau_history"] = [[round(t, 3), tau] for t, tau in h[::max(1, len(h) // 1000)]]
    return RunResult(records, iterations, end_time), extra


def simulated_target(cost, *, replicas: int = 1, depth: int = 1, block_size: int = 16,
                     num_blocks: int = 2048, max_model_len: int = 8192, vocab_size: int = 32000,
                     sched_config: SchedulerConfig | None = None, description: dict | None = None,
                     windows: int = 0, noise_sigma: float = 0.0) -> Target:
    """A Target whose runs go to `replicas` simulated replicas (each `depth` micro-batches in
    flight: the PP degree) with the given cost model; sched_config is the template each run
    copies with its policy and tau. windows > 0: each run's summary has P99 TBT per time window.
    noise_sigma: lognormal iteration-time variation (SimulatedWorker)."""
    import dataclasses

    base = sched_config or SchedulerConfig()

    def run(policy: str, tau: int, workload: list[RequestSpec], drain_s: float, on_progress) -> tuple:
        cfg = dataclasses.replace(base, policy=policy, token_budget=tau, max_model_len=max_model_len)
        reps = [Replica(cost, cfg, block_size=block_size, num_blocks=num_blocks,
                        max_model_len=max_model_len, vocab_size=vocab_size, depth=depth,
                        noise_sigma=noise_sigma, seed=i)
                for i in range(replicas)]
        return run_replicas(reps, workload, drain_s=drain_s, on_progress=on_progress, windows=windows)

    return Target("sim", run=run, max_model_len=max_model_len, vocab_size=vocab_size,
                  description=description or {})
