"""The scheduler service: queue in, engine loop against remote workers, token events out.

One thread runs `SchedulerService.run()`; each turn of the loop:

1. apply aborts sent by gateways (they take effect at the scheduler's next step boundary);
2. pull new requests from the queue only when there is room (pull-based admission: an idle
   replica takes work, a busy one leaves it for others); an invalid request gets an "error"
   TokenEvent and is acked at once, so it is never replayed;
3. run one iteration of the engine loop and publish its TokenEvents to each request's gateway;
4. ack every request that ended (finished, aborted or failed): until then it stays in the
   queue's pending set, which is what a restarted scheduler replays (recomputing from the
   prompt; the gateway drops the events it has already seen, by index).

Failure rules (no accepted request may hang): if the workers fail an iteration, the requests of
that batch end with an "error" event; if a worker restarted (its KV cache is gone), every
request holding KV blocks does. Unseeded requests get a seed derived from their id, so that a
replay after a crash regenerates the very same tokens.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
import zlib

from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.metrics import InstrumentedExecutor, SchedulerMetrics, start_http
from scheduler_svc.pipeline import PipelinedLoop
from scheduler_svc.remote_executor import WorkerError, WorkerRestartedError
from scheduler_svc.scheduler import Scheduler
from shared.messages import RequestMsg, TokenEvent
from shared.queue import SchedulerQueue
from shared.sampling import InvalidRequestError

log = logging.getLogger("sarathi.scheduler")


class SchedulerService:
    """max_waiting: requests held in the local waiting queue at most (beyond it, new requests
    stay in the shared queue for other replicas). idle_block_ms: ms to wait on the queue when
    there is nothing to run. replay_interval_s: seconds between claims of dead replicas' work."""

    def __init__(self, scheduler: Scheduler, executor, queue: SchedulerQueue,
                 metrics: SchedulerMetrics, *, max_waiting: int = 64, idle_block_ms: int = 50,
                 replay_interval_s: float = 5.0):
        self.scheduler = scheduler
        self.executor = InstrumentedExecutor(executor, metrics)
        self.loop = EngineLoop(scheduler, self.executor)
        # a TP x PP replica: up to pp micro-batches in flight (scheduler_svc.pipeline); also with
        # pp = 1, so that a rank reporting a lost peer fails the batch at once
        self.pipeline: PipelinedLoop | None = None
        layout = getattr(executor, "parallel", None)
        if hasattr(executor, "submit") and isinstance(layout, dict) and layout.get("world_size", 1) > 1:
            self.pipeline = PipelinedLoop(scheduler, executor, executor.pipeline_depth,
                                          on_batch=lambda b, _o, sec: metrics.observe_batch(b, sec))
        self.queue = queue
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.idle_block_ms = idle_block_ms
        self.replay_interval_s = replay_interval_s
        self.reply_to: dict[str, str] = {}   # req_id -> gateway id, for every unfinished request
        self.next_index: dict[str, int] = {}  # req_id -> index of its next TokenEvent
        self.snapshot: dict = scheduler.stats()  # read by the HTTP thread: replaced, never mutated
        self.running = False
        self.http_port: int | None = None  # set by run_scheduler when it serves HTTP
        self._last_replay = 0.0

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Replay this consumer's pending requests, then loop until `stop` is set. Requests still
        unfinished at the stop are not acked: the next start replays them."""
        # Start-up objects live forever: move them out of the GC's sight, so cyclic collections
        # stay short (bench/results/scheduler_overhead.md: p99 at 1024 running 52 -> 8 ms).
        gc.freeze()
        self._admit(self.queue.replay_pending())
        self._last_replay = time.monotonic()
        self.running = True
        try:
            while not stop.is_set():
                self.run_once()
        finally:
            self.running = False

    def run_once(self) -> None:
        for req_id in self.queue.poll_aborts():
            self.scheduler.abort(req_id)  # unknown ids are ignored by the scheduler
        self._pull()
        if self.scheduler.has_unfinished():
            self._publish(self._step())
        self.snapshot = self.scheduler.stats()
        self.metrics.observe_stats(self.snapshot)

    def _pull(self) -> None:
        waiting, running = len(self.scheduler.waiting), len(self.scheduler.running)
        room = min(self.max_waiting - waiting, self.scheduler.config.max_num_seqs - running - waiting)
        idle = not self.scheduler.has_unfinished()
        if room > 0:
            self._admit(self.queue.fetch(room, block_ms=self.idle_block_ms if idle else 0))
            if time.monotonic() - self._last_replay > self.replay_interval_s:
                self._last_replay = time.monotonic()
                self._admit(self.queue.replay_pending())  # claims a dead replica's requests
        elif idle:
            time.sleep(self.idle_block_ms / 1000)

    def _step(self) -> list[TokenEvent]:
        try:
            return (self.pipeline or self.loop).step()
        except WorkerRestartedError as e:  # the KV of every running request is gone
            log.error("%s; failing every request that holds KV blocks", e)
            self.scheduler.block_manager.forget_cached_contents()  # cached prefixes are gone too
            self._recover(str(e), [r.req_id for r in self.scheduler.running])
        except WorkerError as e:
            log.error("iteration failed: %s", e)
            self._recover(f"the worker failed this request's iteration: {e}", [])
        except Exception as e:  # a bug must not leave requests hanging: fail them, keep serving
            log.exception("engine step failed")
            self._recover(f"internal error: {type(e).__name__}: {e}", list(self.scheduler.requests))
        self.metrics.failed_iterations.inc()
        return self.scheduler.take_events()

    def _recover(self, message: str, also_fail: list[str]) -> None:
        """After a failed step nothing is outstanding (a step is synchronous), so no request may
        stay marked in flight (aborts wait for that mark to clear). The requests of the lost
        batch, and `also_fail`, end with an "error" event at the next step boundary."""
        batch, self.executor.in_flight = self.executor.in_flight, None
        if batch is not None:
            self.scheduler.fail_batch(batch, message)
        for lost in self.pipeline.take_in_flight() if self.pipeline is not None else []:
            self.scheduler.fail_batch(lost, message)
        for req in self.scheduler.requests.values():
            req.in_flight = False
        for req_id in also_fail:
            self.scheduler.abort(req_id, error=message)

    # -- requests in and events out -----------------------------------------------------------------
    def _admit(self, msgs: list[RequestMsg]) -> None:
        for msg in msgs:
            if msg.req_id in self.reply_to:
                continue  # a replay of a request we are already running
            self.reply_to[msg.req_id] = msg.reply_to
            self.next_index[msg.req_id] = 0
            try:
                self.scheduler.add_request(msg.req_id, msg.prompt_token_ids, _seeded(msg),
                                           arrival_time=self._to_clock(msg.arrival_time))
            except InvalidRequestError as e:
                self.metrics.rejected.inc()
                self._publish([TokenEvent(msg.req_id, 0, None, "error", e.message,
                                          len(msg.prompt_token_ids))])

    def _to_clock(self, wall_time: float) -> float:
        """A gateway's time.time() arrival on the scheduler's clock (seconds)."""
        return self.scheduler.clock() - max(0.0, time.time() - wall_time)

    def _publish(self, events: list[TokenEvent]) -> None:
        if not events:
            return
        for ev in events:
            if ev.token_id is None:  # an end event goes after the tokens already sent
                ev.index = max(ev.index, self.next_index.get(ev.req_id, 0))
            self.next_index[ev.req_id] = ev.index + 1
        self.queue.publish(events, {e.req_id: self.reply_to[e.req_id] for e in events
                                    if e.req_id in self.reply_to})
        for ev in events:
            if ev.finish_reason is not None:
                self.queue.ack(ev.req_id)
                self.reply_to.pop(ev.req_id, None)
                self.next_index.pop(ev.req_id, None)
                self.metrics.finished.labels(reason=ev.finish_reason).inc()


def _seeded(msg: RequestMsg):
    """The request's sampling, with a seed derived from its id if it has none (see module doc)."""
    if msg.sampling.seed is not None:
        return msg.sampling
    return dataclasses.replace(msg.sampling, seed=zlib.crc32(msg.req_id.encode()))


def run_scheduler(*, redis_url: str | None = None, worker_addr: str | list[str] = "tcp://127.0.0.1:5555",
                  policy: str = "sarathi", token_budget: int = 512, max_num_seqs: int = 128,
                  max_num_batched_tokens: int = 4096, prefix_caching: bool = False,
                  max_model_len: int | None = None, metrics_port: int | None = 9100,
                  metrics_host: str = "0.0.0.0", consumer: str | None = None,
                  queue_prefix: str = "sarathi:",
                  worker_timeout_s: float = 120.0, model: str | None = None,
                  queue: SchedulerQueue | None = None, executor=None,
                  registry=None, stop: threading.Event | None = None,
                  on_ready=None) -> None:
    """Run a scheduler service until `stop` is set (forever when None).

    redis_url: the Redis queue (None: `queue` must be given, e.g. embedded mode's in-process one).
    worker_addr: ZeroMQ address(es) of the workers, a list or comma-separated (all ranks of this
    replica; the last one samples).
    policy, token_budget (tau, tokens), max_num_seqs, max_num_batched_tokens, prefix_caching: the
    scheduling knobs (shared.config.SchedulerConfig). max_model_len: tokens; None = the model's.
    metrics_port: HTTP port for /metrics /health /ready /stats (None: no server; 0: any free port).
    consumer: the queue consumer name (default: stable per host, see shared.queue); a restarted
    scheduler with the same name replays its own pending requests. queue_prefix: Redis key prefix.
    model: accepted for symmetry with the other services; the model is what the workers loaded.
    executor: use this object instead of connecting to workers (tests: a SimExecutor; it must have
    a `model_info`). registry: Prometheus registry (default: a new one with the process metrics;
    embedded mode passes the gateway's, so that one /metrics shows both).
    on_ready: called with the SchedulerService once the workers answered and before the loop.
    """
    from scheduler_svc.remote_executor import RemoteExecutor
    from shared.config import CacheConfig, SchedulerConfig
    from shared.queue import QueueConfig, make_scheduler_queue

    metrics = SchedulerMetrics(registry if registry is not None else _process_registry())
    metrics.set_config(policy, token_budget)
    services: list[SchedulerService] = []  # filled once the workers answered
    server = None
    if metrics_port is not None:  # up first: /health answers while the workers still load
        server, _ = start_http(metrics_port, metrics_host, metrics.registry,
                               lambda: bool(services) and services[0].running,
                               lambda: services[0].snapshot if services else {})
        log.info("scheduler metrics on http://%s:%d/metrics", metrics_host, server.server_port)
    try:
        if executor is None:
            executor = RemoteExecutor(worker_addr, timeout_s=worker_timeout_s)
            log.info("waiting for workers at %s", worker_addr)
        info = _wait_for_model_info(executor, stop)
        if info is None:
            return
        if model is not None and str(model) not in ("", "default", info.name):
            log.info("--model %s given to the scheduler; the workers serve %s", model, info.name)
        cfg = SchedulerConfig(policy=policy, token_budget=token_budget, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              enable_prefix_caching=prefix_caching,
                              max_model_len=max_model_len or info.max_model_len)
        scheduler = Scheduler(cfg, CacheConfig(info.block_size, info.num_blocks), info)
        queue = queue or make_scheduler_queue(redis_url, consumer=consumer,
                                              config=QueueConfig(prefix=queue_prefix))
        service = SchedulerService(scheduler, executor, queue, metrics)
        service.http_port = server.server_port if server is not None else None
        services.append(service)
        log.info("scheduler ready: policy=%s tau=%d model=%s max_model_len=%d kv=%dx%d", policy,
                 token_budget, info.name, scheduler.max_model_len, info.num_blocks, info.block_size)
        if on_ready is not None:
            on_ready(service)
        try:
            service.run(stop or threading.Event())
        finally:
            queue.close()
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


def _wait_for_model_info(executor, stop: threading.Event | None):
    """The workers' ModelInfo, retrying until they answer (they may still be loading weights);
    None if `stop` is set first."""
    wait = getattr(executor, "wait_ready", None)
    while wait is not None:
        try:
            return wait(1.0)
        except WorkerError:
            if stop is not None and stop.is_set():
                return None
    return executor.model_info


def _process_registry():
    """A fresh registry (so that several schedulers can run in one process, as in tests) with
    the process and platform collectors the global one would have had."""
    from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry
