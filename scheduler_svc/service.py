"""The scheduler service: queue in, an engine against remote workers, token events out.

One thread runs `SchedulerService.run()`; each turn of the loop:

1. apply aborts sent by gateways (they take effect at the scheduler's next step boundary);
2. pull new requests from the queue only when there is room (pull-based admission: an idle
   replica takes work, a busy one leaves it for others); an invalid request gets an "error"
   TokenEvent and is acked at once, so it is never replayed;
3. run one iteration of the engine and publish its TokenEvents to each request's gateway;
4. ack every request that ended (finished, aborted or failed): until then it stays in the
   queue's pending set, which is what a restarted scheduler replays (recomputing from the
   prompt; the gateway drops the events it has already seen, by index).

Failure rules (no accepted request may hang, none is dropped silently):
* the workers fail an iteration (an error reply, a reply timeout): the requests of that batch
  (with a PP replica: of every micro-batch in flight) end with an "error" event;
* a worker's link goes down (its process died: noticed within ~2 s by the link heartbeat, see
  remote_executor; with a TP/PP replica also a rank answering "rank_lost", and every micro-batch
  in flight is dropped with it) or a worker restarted: its KV cache is gone, so every running
  request is preempted (kept with its generated tokens, recomputed later: its stream just
  pauses). While no worker answers, nothing runs and no new request is pulled from the queue;
  once one answers again, the preempted requests run on it; if none answers within
  worker_restart_timeout_s, every request held here ends with an "error" event;
* the queue is unreachable (Redis down or restarting): token events and acks wait in order in an
  outbox and go out once it is back; the loop keeps running what it has;
* a request that fails once the service is stopping (its worker may have gone first, as when
  a pod's containers get SIGTERM together) is not ended: its "error" event is withheld and it
  stays pending, to be finished (or failed) by the replica that replays it.
Unseeded requests get a seed derived from their id, so that a replay after a crash regenerates
the very same tokens.

Exactly one runner per request, and health that tells the truth:
* the replica's liveness in the queue (its heartbeat, which keeps its requests from being
  claimed by other replicas) comes from a thread of its own, not from the loop: a replica busy in
  one long batch keeps its requests. The thread stops heartbeating once the loop is stalled (see
  below), so a wedged replica's requests do go to the others;
* a request claimed away by another replica (the queue's take_lost) is dropped here: it stops
  running, nothing more is published or acked for it (the queue's epoch fence drops the rest);
* the requests of a gateway whose lease expired (it died: nobody reads their tokens) are
  aborted instead of run to max_tokens;
* the watchdog: the loop is "stalled" when it has not finished a turn for stall_timeout_s while
  it holds unfinished requests; /health then answers 503 (the Kubernetes liveness probe restarts
  the process; its requests are replayed by whoever takes them). stall_timeout_s must exceed the
  longest legitimate turn: the worker reply timeout.

One engine (scheduler_svc.engine) runs the iterations: an EngineLoop for one worker (depth 1) or
one TP x PP replica (up to pp batches in flight), or a PoolSet for several worker pools
(scheduler_svc.pools, whose module doc has its own failure rules: a lost pool's requests move to
the pools that are up). The engine knows the batches in flight and applies the rules above; the
service only asks it, between steps, whether to wait for a worker, and hands it what a step
raised.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
import zlib
from typing import Callable

from scheduler_svc.engine import Engine
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.metrics import SchedulerMetrics, queue_backlog, start_http
from scheduler_svc.pools import PoolSet, make_pool
from scheduler_svc.remote_executor import WorkerError
from scheduler_svc.router import Router, RouterConfig
from scheduler_svc.scheduler import Scheduler
from shared.config import CacheConfig, SchedulerServiceConfig
from shared.messages import RequestMsg, TokenEvent
from shared.queue import QueueUnavailableError, SchedulerQueue
from shared.sampling import InvalidRequestError

log = logging.getLogger("sarathi.scheduler")


class SchedulerService:
    """Runs one engine (scheduler_svc.engine.Engine: an EngineLoop over one worker or replica,
    or a PoolSet over several pools) against the queue. max_waiting: requests held in the local
    waiting queue at most (beyond it, new requests stay in the shared queue for other replicas).
    idle_block_ms: ms to wait on the queue when there is nothing to run. replay_interval_s:
    seconds between claims of dead replicas' work. How long the requests of a lost worker wait
    for it is the engine's (restart_timeout_s). heartbeat_interval_s: seconds between the
    heartbeat thread's heartbeats (None: the queue's QueueConfig.heartbeat_interval_s).
    stall_timeout_s: seconds without a finished loop turn, while requests are unfinished, after
    which the loop counts as stalled (see the module doc).
    gateway_check_interval_s: seconds between checks of the gateways' leases (None: a third of
    the queue's QueueConfig.gateway_ttl_s)."""

    def __init__(self, engine: Engine, queue: SchedulerQueue, metrics: SchedulerMetrics, *,
                 max_waiting: int = 64, idle_block_ms: int = 50, replay_interval_s: float = 5.0,
                 heartbeat_interval_s: float | None = None, stall_timeout_s: float = 180.0,
                 gateway_check_interval_s: float | None = None):
        self.engine = engine
        self.queue = queue
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.idle_block_ms = idle_block_ms
        self.replay_interval_s = replay_interval_s
        qcfg = getattr(queue, "cfg", None)
        self.heartbeat_interval_s = heartbeat_interval_s or getattr(qcfg, "heartbeat_interval_s", 1.0)
        self.stall_timeout_s = stall_timeout_s
        self.gateway_check_interval_s = gateway_check_interval_s or getattr(qcfg, "gateway_ttl_s", 15.0) / 3
        self._progress_at = time.monotonic()  # end of the loop's last turn
        self._busy = False                    # unfinished requests at that moment
        self._disowned: set[str] = set()      # claimed away: their events are not ours to send
        self._gateways_missing: set[str] = set()  # leases missing at the last check
        self._last_gateway_check = time.monotonic()
        self.reply_to: dict[str, str] = {}   # req_id -> gateway id, for every unfinished request
        self.snapshot: dict = engine.stats()  # read by the HTTP thread: replaced, never mutated
        self.running = False
        self.http_port: int | None = None  # set by run_scheduler when it serves HTTP
        self._last_replay = 0.0
        self._outbox: list[TokenEvent] = []   # events not yet published (queue unreachable)
        self._to_ack: list[str] = []          # ended requests whose end event is out, not yet acked
        self._queue_down = False
        self._stopping: threading.Event | None = None  # run()'s stop: set once it is stopping

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Replay this consumer's pending requests, then loop until `stop` is set. Requests still
        unfinished at the stop are not acked: the next start replays them."""
        # Start-up objects live forever: move them out of the GC's sight, so cyclic collections
        # stay short (bench/results/scheduler/scheduler_overhead.md: p99 at 1024 running 52 -> 8 ms).
        # Collect first: frozen garbage would never be freed (nor its sockets closed).
        gc.collect()
        gc.freeze()
        self._stopping = stop
        beating = threading.Event()
        heart = threading.Thread(target=self._heartbeat_loop, args=(stop, beating),
                                 name="scheduler-heartbeat", daemon=True)
        heart.start()
        try:
            self._admit(self.queue.replay_pending())
            self._last_replay = time.monotonic()
            self._progress_at = time.monotonic()
            self.running = True
            while not stop.is_set():
                self.run_once()
        finally:
            self.running = False
            beating.set()
            heart.join(5)

    def _heartbeat_loop(self, stop: threading.Event, done: threading.Event) -> None:
        """The heartbeat thread: the replica's liveness, independent of how long a batch takes;
        none while the loop is stalled (its requests must then go to the other replicas)."""
        while not (stop.is_set() or done.is_set()):
            if not self.stalled():
                try:
                    self.queue.heartbeat()
                except Exception as e:  # noqa: BLE001 - Redis down: the loop reports it; retry
                    log.debug("heartbeat failed: %s", e)
            done.wait(self.heartbeat_interval_s)

    def stalled(self) -> bool:
        """True when the loop has not finished a turn for stall_timeout_s while requests were
        unfinished (any thread)."""
        return self._busy and time.monotonic() - self._progress_at > self.stall_timeout_s

    def health(self) -> tuple[bool, str]:
        """(healthy, a one-line reason): what /health answers."""
        if self.stalled():
            return False, (f"stalled: the scheduling loop has not advanced for "
                           f"{time.monotonic() - self._progress_at:.0f} s with requests unfinished")
        return True, "ok"

    @property
    def worker_up(self) -> bool:
        return self.engine.worker_up

    def stats_json(self) -> dict:
        """What /stats answers (called by the HTTP thread): the last stats snapshot; with pools,
        plus `kv_transfers`: one dict per handed-off request (req_id, prefill_pool, decode_pool,
        kv_bytes, kv_transfer_s, queue_s, prefill_s; seconds)."""
        transfers = getattr(self.engine, "transfer_dicts", None)
        return self.snapshot if transfers is None else {**self.snapshot, "kv_transfers": transfers()}

    def run_once(self) -> None:
        self._talk_to_queue(self._flush, self._drop_lost, self._check_gateways, self._take_in)
        if not self.engine.check_worker():
            events = self.engine.wait_for_worker()   # briefly; the requests past the restart timeout end
            if events:
                self._publish(events)
        elif self.engine.has_work():
            idle = not self.engine.has_unfinished()   # stepped only to ask lost workers back
            events = self._step()
            events += self._send_next()
            self._publish(events)
            if idle and not self.worker_up:
                time.sleep(0.2)                       # nothing pulled (no worker): do not spin
        elif self._queue_down:
            time.sleep(0.2)  # nothing to run and nobody to talk to: do not spin
        self.snapshot = self.engine.stats()
        self.metrics.observe_stats(self.snapshot)
        if "pools" in self.snapshot:
            self.metrics.observe_pools(self.snapshot["pools"])
        self.metrics.worker_up.set(1 if self.worker_up else 0)
        self._busy = self.engine.has_unfinished()
        self._progress_at = time.monotonic()

    def _talk_to_queue(self, *ops: Callable[[], None]) -> None:
        """Run the queue operations in order; an unreachable queue (or a queue bug) is logged
        and marks the queue down, to be retried on the next turn, never stopping the loop."""
        try:
            for op in ops:
                op()
            self._set_queue_down(False)
        except QueueUnavailableError as e:
            self._set_queue_down(True, e)
        except Exception as e:  # noqa: BLE001 - a queue bug must not stop the loop: log, retry
            log.exception("queue operation failed")
            self._set_queue_down(True, e)

    def _take_in(self) -> None:
        """Aborts, then new requests (when a worker can run them)."""
        for req_id in self.queue.poll_aborts():
            self.engine.abort(req_id)  # unknown ids are ignored by the engine
        if self.worker_up:
            self._pull()

    def _drop_lost(self) -> None:
        """Stop the requests another replica claimed from this one (see the module doc)."""
        for req_id in self.queue.take_lost():
            if self.reply_to.pop(req_id, None) is not None:
                self._disowned.add(req_id)
                self.engine.abort(req_id)

    def _check_gateways(self) -> None:
        """Abort the requests of gateways whose lease was missing on two checks in a row (one
        miss may be a Redis that restarted empty before the gateway renewed it)."""
        if time.monotonic() - self._last_gateway_check < self.gateway_check_interval_s:
            return
        self._last_gateway_check = time.monotonic()
        missing = self.queue.dead_gateways(set(self.reply_to.values()))
        dead, self._gateways_missing = missing & self._gateways_missing, missing
        if dead:
            doomed = [r for r, gw in self.reply_to.items() if gw in dead]
            log.warning("gateway(s) %s gone: aborting their %d request(s)", ", ".join(sorted(dead)),
                        len(doomed))
            for req_id in doomed:
                self.engine.abort(req_id)

    def _set_queue_down(self, down: bool, exc: Exception | None = None) -> None:
        if down and not self._queue_down:
            log.error("the queue is unreachable (%s); events wait in the outbox", exc)
        elif not down and self._queue_down:
            log.info("the queue is reachable again")
        self._queue_down = down

    def _pull(self) -> None:
        engine = self.engine
        waiting, running = engine.num_waiting, engine.num_running
        room = min(self.max_waiting - waiting, engine.max_num_seqs - running - waiting)
        idle = not engine.has_unfinished()
        if room > 0:
            self._admit(self.queue.fetch(room, block_ms=self.idle_block_ms if idle else 0))
            if time.monotonic() - self._last_replay > self.replay_interval_s:
                self._last_replay = time.monotonic()
                self._admit(self.queue.replay_pending())  # claims a dead replica's requests
        elif idle:
            time.sleep(self.idle_block_ms / 1000)

    def _send_next(self) -> list[TokenEvent]:
        """Right after a step: take the aborts and requests that came meanwhile, then submit the
        next batch at once (Engine.fill), so that the worker computes it while this process
        publishes the step's events, updates its metrics and talks to the queue, instead of
        waiting for all that. The batches are the ones the next step would have sent. Returns
        the events that came of it: aborts taken, or a failed submission (the engine's fault
        rules)."""
        fill = getattr(self.engine, "fill", None)
        if fill is None or not self.worker_up or not self.engine.has_unfinished():
            return []
        self._talk_to_queue(self._take_in)
        try:
            fill()
        except Exception as e:  # noqa: BLE001 - as in _step
            self.metrics.failed_iterations.inc()
            return self.engine.recover(e)
        return self.engine.take_events()   # aborts that scheduling took

    def _step(self) -> list[TokenEvent]:
        try:
            return self.engine.step()
        except Exception as e:  # the engine's fault rules decide what becomes of its requests
            self.metrics.failed_iterations.inc()
            return self.engine.recover(e)

    # -- requests in and events out -----------------------------------------------------------------
    def _admit(self, msgs: list[RequestMsg]) -> None:
        for msg in msgs:
            if msg.req_id in self.reply_to:
                continue  # a replay of a request we are already running
            self.reply_to[msg.req_id] = msg.reply_to
            try:
                self.engine.add_request(msg.req_id, msg.prompt_token_ids, _seeded(msg),
                                        arrival_time=self._to_clock(msg.arrival_time),
                                        share_prompt_with=msg.share_prompt_with)
            except InvalidRequestError as e:
                self.metrics.rejected.inc()
                self._publish([Scheduler.rejection_event(msg.req_id, len(msg.prompt_token_ids), e)])

    def _to_clock(self, wall_time: float) -> float:
        """A gateway's time.time() arrival on the scheduler's clock (seconds)."""
        return self.engine.clock() - max(0.0, time.time() - wall_time)

    def _publish(self, events: list[TokenEvent]) -> None:
        """Send the events as the scheduler numbered them (in order, after any still in the
        outbox); a request is acked only once its end event is out."""
        if self._disowned:
            ended = {e.req_id for e in events if e.finish_reason is not None} & self._disowned
            events = [e for e in events if e.req_id not in self._disowned]
            self._disowned -= ended
        if self._stopping is not None and self._stopping.is_set():
            events = self._leave_failures(events)
        for ev in events:
            if ev.finish_reason is not None:
                self.metrics.finished.labels(reason=ev.finish_reason).inc()
        self._outbox.extend(events)
        try:
            self._flush()
        except QueueUnavailableError as e:
            self._set_queue_down(True, e)
        except Exception as e:  # noqa: BLE001 - as in run_once: keep the events, retry later
            log.exception("publishing failed")
            self._set_queue_down(True, e)

    def _leave_failures(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """While stopping: the events without their "error" ends. Those requests are neither
        answered nor acked here but left pending, for the replica that replays them (the engine
        has dropped them, so nothing more of theirs comes from this one)."""
        left = {e.req_id for e in events if e.finish_reason == "error"}
        if left:
            log.warning("stopping: %d request(s) that failed are left for replay: %s", len(left),
                        next(e.error for e in events if e.finish_reason == "error"))
        return [e for e in events if e.req_id not in left]

    def _flush(self) -> None:
        """Publish the outbox, then ack what ended. Raises QueueUnavailableError, keeping what
        was not sent (a resent publish may duplicate events: the gateway drops them by index)."""
        if self._outbox:
            events = self._outbox
            self.queue.publish(events, {e.req_id: self.reply_to[e.req_id] for e in events
                                        if e.req_id in self.reply_to})
            self._outbox = []
            self._to_ack += [e.req_id for e in events if e.finish_reason is not None]
        while self._to_ack:
            self.queue.ack(self._to_ack[0])
            self.reply_to.pop(self._to_ack.pop(0), None)


def _seeded(msg: RequestMsg):
    """The request's sampling, with a seed derived from its id if it has none (see module doc)."""
    if msg.sampling.seed is not None:
        return msg.sampling
    return dataclasses.replace(msg.sampling, seed=zlib.crc32(msg.req_id.encode()))


def run_scheduler(config: SchedulerServiceConfig, *, queue: SchedulerQueue | None = None,
                  executor=None, registry=None, stop: threading.Event | None = None,
                  on_ready=None) -> None:
    """Run a scheduler service (shared.config.SchedulerServiceConfig) until `stop` is set
    (forever when None).

    The objects a caller may hand in instead of what the config names: queue (instead of the
    Redis queue at config.redis_url; embedded mode's in-process one), executor (instead of
    connecting to config.worker_addrs; tests: a SimExecutor, which must have a `model_info`),
    registry (the Prometheus registry; default: a new one with the process metrics; embedded mode
    passes the gateway's, so that one /metrics shows both). on_ready: called with the
    SchedulerService once the workers answered and before the loop.
    """
    c = config
    metrics = SchedulerMetrics(registry if registry is not None else _process_registry())
    metrics.set_config(c.scheduler.policy, c.scheduler.token_budget)
    services: list[SchedulerService] = []  # filled once the workers answered
    server = None
    if c.metrics_port is not None:  # up first: /health answers while the workers still load
        server, _ = start_http(c.metrics_port, c.metrics_host, metrics.registry,
                               lambda: bool(services) and services[0].running and services[0].worker_up,
                               lambda: services[0].stats_json() if services else {},
                               health=lambda: services[0].health() if services else (True, "ok"))
        log.info("scheduler metrics on http://%s:%d/metrics", c.metrics_host, server.server_port)
    try:
        run = _run_pools if c.disagg.enabled else _run_single
        run(c, queue, executor, metrics, services, server, stop, on_ready)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


def loop_engine(scheduler: Scheduler, executor, metrics: SchedulerMetrics,
                restart_timeout_s: float = 30.0) -> EngineLoop:
    """The engine of one worker or one TP x PP replica: up to pp batches in flight (the
    executor's pipeline_depth; a single worker 1), every collected batch and every loss of the
    worker counted in `metrics`; a lost worker's requests wait restart_timeout_s for it."""
    return EngineLoop(scheduler, executor, getattr(executor, "pipeline_depth", 1),
                      on_batch=lambda batch, _out, seconds: metrics.observe_batch(batch, seconds),
                      restart_timeout_s=restart_timeout_s, on_worker_lost=metrics.worker_lost.inc)


def _run_single(c: SchedulerServiceConfig, queue, executor, metrics, services, server, stop,
                on_ready) -> None:
    """run_scheduler with one worker (or one TP x PP replica): one Scheduler, one EngineLoop."""
    from scheduler_svc.remote_executor import RemoteExecutor

    owned = None   # the RemoteExecutor made here, closed at the end (a given executor is the caller's)
    publisher = None
    try:
        if executor is None:
            executor = owned = RemoteExecutor(c.worker_addrs, timeout_s=c.worker_timeout_s)
            log.info("waiting for workers at %s", ", ".join(c.worker_addrs))
        info = _wait_for_model_info(executor, stop)
        if info is None:
            return
        metrics.set_worker(info.name, info.backend, info.block_size)
        cfg = dataclasses.replace(c.scheduler, max_model_len=c.max_model_len or info.max_model_len)
        scheduler = Scheduler(cfg, CacheConfig(info.block_size, info.num_blocks), info)
        if cfg.kv_events_config is not None:   # transport security for it: start_publisher's socket_hook
            from scheduler_svc.kv_events import start_publisher
            publisher = start_publisher(cfg.kv_events_config, scheduler.block_manager)
        queue = _queue(c, queue)
        service = SchedulerService(loop_engine(scheduler, executor, metrics, c.worker_restart_timeout_s),
                                   queue, metrics, stall_timeout_s=stall_timeout(c))
        log.info("scheduler ready: policy=%s tau=%d model=%s max_model_len=%d kv=%dx%d worker=%s%s",
                 cfg.policy, cfg.token_budget, info.name, scheduler.max_model_len, info.num_blocks,
                 info.block_size, info.backend,
                 "; async scheduling (one batch planned ahead)" if cfg.async_scheduling else "")
        _serve(service, queue, services, server, stop, on_ready)
    finally:
        if owned is not None:
            owned.close()
        if publisher is not None:
            publisher.close()


def stall_timeout(c: SchedulerServiceConfig) -> float:
    """The watchdog's stall_timeout_s: the configured one (c.stall_timeout_s; 0: the worker
    reply timeout plus 60 s), never below the worker reply timeout, since a turn may
    legitimately wait that long for one batch."""
    configured = c.stall_timeout_s or c.worker_timeout_s + 60.0
    if configured <= c.worker_timeout_s:
        log.warning("the stall timeout (%g s) must exceed the worker reply timeout (%g s); using the latter",
                    configured, c.worker_timeout_s)
    return max(configured, c.worker_timeout_s)


def _queue(c: SchedulerServiceConfig, queue: SchedulerQueue | None) -> SchedulerQueue:
    """The queue handed in, else the Redis queue the config names."""
    from shared.queue import QueueConfig, make_scheduler_queue

    return queue or make_scheduler_queue(c.redis_url, consumer=c.consumer,
                                         config=QueueConfig(prefix=c.queue_prefix))


def _serve(service: SchedulerService, queue: SchedulerQueue, services: list, server, stop, on_ready) -> None:
    """Publish the ready service (HTTP thread, on_ready), run it until `stop`, close its queue."""
    service.http_port = server.server_port if server is not None else None
    service.metrics.model_server.backlog = queue_backlog(queue)   # the picker's waiting count
    services.append(service)
    if on_ready is not None:
        on_ready(service)
    try:
        service.run(stop or threading.Event())
    finally:
        queue.close()


def pool_addresses(c: SchedulerServiceConfig) -> list[tuple[str, list[str] | str]]:
    """(role, address) of each pool: every mixed worker (c.worker_addrs, one pool each), then the
    prefill and the decode workers."""
    d = c.disagg
    mixed = [a for a in c.worker_addrs if a] if (d.separate_mixed or not (d.prefill_worker_addrs or
                                                                           d.decode_worker_addrs)) else []
    return ([("mixed", a) for a in mixed] + [("prefill", a) for a in d.prefill_worker_addrs]
            + [("decode", a) for a in d.decode_worker_addrs])


def _run_pools(c: SchedulerServiceConfig, queue, executors, metrics, services, server, stop,
               on_ready) -> None:
    """run_scheduler with worker pools (c.disagg.enabled). executors: None (connect to the
    configured addresses), or a list of (role, executor) handed in (tests)."""
    from scheduler_svc.remote_executor import RemoteExecutor

    owned = []
    if c.scheduler.kv_events_config is not None:
        log.warning("KV-cache events are published by a single replica's scheduler, not with worker pools: "
                    "--kv-events-config is ignored")
    try:
        if executors is None:
            executors = []
            for role, addr in pool_addresses(c):
                ex = RemoteExecutor(addr, timeout_s=c.worker_timeout_s)
                owned.append(ex)
                executors.append((role, ex))
            log.info("waiting for workers: %s", ", ".join(f"{r} {e.addresses[0]}" for r, e in executors))
        for _, ex in executors:
            if _wait_for_model_info(ex, stop) is None:
                return
        counts: dict[str, int] = {}
        pools = []
        for role, ex in executors:
            counts[role] = counts.get(role, 0) + 1
            pools.append(make_pool(f"{role}{counts[role] - 1}", role, ex, c.scheduler, c.max_model_len))
            if role != "prefill" and c.disagg.mode != "off" and pools[-1].kv_address is None:
                raise ValueError(f"the {role} worker at {ex.addresses[0]} has no KV receiver "
                                 "(start it with --kv-address)")
        d = c.disagg
        info = pools[0].scheduler.model_info
        metrics.set_worker(info.name, info.backend, info.block_size)
        pool_set = PoolSet(pools, Router(RouterConfig(d.mode, d.threshold_tokens, d.backlog_margin_tokens)),
                           kv_transfer_timeout_s=d.kv_transfer_timeout_s,
                           kv_transfer_failure=d.kv_transfer_failure,
                           restart_timeout_s=c.worker_restart_timeout_s,
                           on_batch=lambda _pool, batch, _out, seconds: metrics.observe_batch(batch, seconds),
                           on_transfer=metrics.observe_transfer)
        queue = _queue(c, queue)
        service = SchedulerService(pool_set, queue, metrics, stall_timeout_s=stall_timeout(c))
        log.info("scheduler ready: policy=%s tau=%d model=%s pools=%s disaggregation=%s threshold=%d",
                 c.scheduler.policy, c.scheduler.token_budget, info.name,
                 ", ".join(f"{p.name}({p.scheduler.block_manager.num_blocks} blocks)" for p in pools),
                 d.mode, d.threshold_tokens)
        _serve(service, queue, services, server, stop, on_ready)
    finally:
        for ex in owned:
            ex.close()


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
