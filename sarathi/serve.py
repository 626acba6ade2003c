"""Embedded mode: gateway + scheduler + one worker on localhost, one command, one process tree.

With several workers (`--workers M` colocated mixed workers, or `--prefill-workers N
--decode-workers M` for prefill/decode disaggregation) each worker is a child process of its own
(ipc://<tempdir>/worker<i>.sock; decode and mixed workers receive KV blocks at
ipc://<tempdir>/worker<i>.kv) and the scheduler runs one pool per worker (scheduler_svc.pools).

The same components as the distributed mode, wired in one place:

* the worker runs in a child process (default; the model's compute never competes with the
  gateway for the GIL) on ipc://<tempdir>/worker.sock, or in a thread on inproc://worker;
* the scheduler service runs in a thread of this process against that worker (ZeroMQ);
* the gateway (uvicorn) runs in the main thread;
* the queue between them is in-process (no Redis) unless `redis_url` is given;
* one Prometheus registry holds the gateway's and the scheduler's metrics: GET /metrics shows
  both (e.g. sarathi_scheduler_kv_free_blocks next to the gateway's TTFT histogram).

A worker process that dies is started again (same address); the scheduler notices the lost
link within ~2 s, holds its requests and replays them on the new worker (see
scheduler_svc.service). SIGTERM drains (gateway.server.DrainingServer): new requests get 503,
started ones finish (up to drain_timeout_s); then uvicorn stops, then the scheduler thread, then
the worker. Ctrl-C stops at once.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import tempfile
import threading

from shared.config import DisaggConfig, SchedulerServiceConfig, ServeConfig, WorkerConfig, WorkerServiceConfig

log = logging.getLogger("sarathi.serve")


def run_embedded(config: ServeConfig) -> None:
    """Serve config.worker.model (None: the default SmolLM2) on http://host:port until
    interrupted (shared.config.ServeConfig says what each field does)."""
    from prometheus_client import CollectorRegistry

    from gateway.app import create_app
    from gateway.metrics import GatewayMetrics
    from gateway.server import serve_app
    from scheduler_svc.remote_executor import RemoteExecutor
    from scheduler_svc.service import run_scheduler
    from shared.model_source import resolve_model
    from shared.queue import QueueConfig, make_queues
    from shared.tokenizer import load_tokenizer

    c = config
    from gateway.server import check_exposure

    if not c.allow_unauthenticated:  # fail before starting anything (serve_app warns otherwise)
        check_exposure(c.host, bool(c.api_key))
    if not logging.getLogger().handlers:
        logging.basicConfig(level=c.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    source = resolve_model(c.worker.model)  # fail fast on a bad path or file, before starting anything
    tokenizer = load_tokenizer(source)
    # the worker's profiling pass (CUDA) covers the largest iteration the policy can make
    engine = dataclasses.replace(c.worker, model=str(source.path),
                                 max_num_seqs=c.scheduler.max_num_seqs,
                                 max_num_batched_tokens=c.scheduler.max_tokens_per_iteration)
    with tempfile.TemporaryDirectory(prefix="sarathi-") as tmp:
        roles = c.worker_roles() if c.pools else ["mixed"]
        handles: list[_WorkerHandle] = []
        stop = threading.Event()
        sched_thread = None
        try:
            executors = []
            for i, role in enumerate(roles):
                kv = f"ipc://{tmp}/worker{i}.kv" if c.pools and role != "prefill" else None
                handle, address = _start_worker(c.worker_mode, engine, tmp, f"worker{i}" if c.pools else "worker",
                                                role, kv)
                handles.append(handle)
                executors.append((role, RemoteExecutor(address, timeout_s=120.0)))
            infos = [_wait_worker(ex, h) for (_, ex), h in zip(executors, handles)]
            info = infos[0]
            if c.worker_mode == "process":  # from now on a dead worker is replaced (not while it first loads)
                for h in handles:
                    threading.Thread(target=_supervise, args=(h, stop), name="worker-supervisor",
                                     daemon=True).start()
            max_len = min(c.max_model_len or info.max_model_len, info.max_model_len)
            gateway_queue, scheduler_queue = make_queues(c.redis_url, config=QueueConfig(prefix=c.queue_prefix))
            registry = CollectorRegistry()
            disagg = DisaggConfig()
            if c.pools:
                # the executors are handed in: the addresses only count the workers of each role
                disagg = DisaggConfig(["-"] * c.prefill_workers, ["-"] * c.decode_workers, separate_mixed=True,
                                      mode=c.disaggregation, threshold_tokens=c.disagg_threshold,
                                      backlog_margin_tokens=c.disagg_backlog_margin,
                                      kv_transfer_timeout_s=c.kv_transfer_timeout_s,
                                      kv_transfer_failure=c.kv_transfer_failure)
            sched_config = SchedulerServiceConfig(
                scheduler=c.scheduler, max_model_len=max_len, metrics_port=c.scheduler_port,
                metrics_host=c.host, worker_restart_timeout_s=c.worker_restart_timeout_s, disagg=disagg)
            executor = executors if c.pools else executors[0][1]
            sched_thread = threading.Thread(target=run_scheduler, args=(sched_config,), name="scheduler",
                                            daemon=True, kwargs=dict(queue=scheduler_queue, executor=executor,
                                                                     registry=registry, stop=stop))
            sched_thread.start()
            app = create_app(tokenizer, dataclasses.replace(info, max_model_len=max_len),
                             gateway_queue, api_key=c.api_key, metrics=GatewayMetrics(registry),
                             parse_control_tokens=c.parse_control_tokens)
            log.info("serving %s on http://%s:%d (queue: %s, workers: %s)", info.name, c.host, c.port,
                     c.redis_url or "in-process", ", ".join(f"{r} {ex.addresses[0]}" for r, ex in executors))
            serve_app(app, host=c.host, port=c.port, log_level=c.log_level, drain_timeout_s=c.drain_timeout_s,
                      allow_unauthenticated=c.allow_unauthenticated)
        finally:
            stop.set()
            if sched_thread is not None:
                sched_thread.join(10)
            for h in handles:
                h()


def _wait_worker(executor, stop_worker):
    """The worker's ModelInfo once it has loaded the model; raises if it died while loading."""
    from scheduler_svc.remote_executor import WorkerError

    while True:
        try:
            return executor.wait_ready(2.0)
        except WorkerError:
            if not stop_worker.alive():
                raise RuntimeError("the worker exited while loading the model (see its log above)")


def _supervise(handle, stop: threading.Event) -> None:
    """Start the worker process again whenever it died, until `stop`."""
    while not stop.wait(0.5):
        if not handle.alive() and handle.restart is not None:
            log.error("the worker process exited; starting a new one")
            handle.restart()


class _WorkerHandle:
    """Stops the worker (call it); alive() says whether it still runs; restart() (processes
    only) starts a new one on the same address."""

    def __init__(self, stop, alive, restart=None):
        self._stop, self.alive, self.restart = stop, alive, restart
        self.stopped = False

    def __call__(self) -> None:
        self.stopped = True
        self._stop()


def _start_worker(kind: str, engine: WorkerConfig, tmp: str, name: str = "worker", role: str = "mixed",
                  kv_address: str | None = None):
    """Start one worker (a thread or a child process) on ipc://<tmp>/<name>.sock; its KV link
    receives at kv_address (None: it only sends)."""
    if kind == "thread":
        from kvstore.link import make_kv_link
        from worker_svc.service import run_worker
        stop = threading.Event()
        config = WorkerServiceConfig(engine, address=f"inproc://{name}", role=role, kv_address=kv_address)
        t = threading.Thread(target=run_worker, args=(config,), name=name, daemon=True,
                             kwargs=dict(stop=stop, kv_link=make_kv_link))
        t.start()
        return _WorkerHandle(lambda: (stop.set(), t.join(10)), t.is_alive), f"inproc://{name}"
    address = f"ipc://{tmp}/{name}.sock"
    procs: list = []
    lock = threading.Lock()

    def start() -> None:
        # spawn, not fork: a forked child would inherit this process's threads and sockets
        proc = mp.get_context("spawn").Process(
            target=_worker_main, name=f"sarathi-{name}", daemon=True,
            args=(WorkerServiceConfig(engine, address, role=role, kv_address=kv_address), os.getpid()))
        with lock:
            if handle.stopped:
                return
            proc.start()
            procs[:] = [proc]
        log.info("worker process started (pid %d) as %s %s", proc.pid, role, name)

    def stop() -> None:
        with lock:
            proc = procs[0] if procs else None
        if proc is not None:
            proc.terminate()
            proc.join(10)
            if proc.is_alive():
                proc.kill()

    handle = _WorkerHandle(stop, lambda: bool(procs) and procs[0].is_alive(), start)
    start()
    return handle, address


def _worker_main(config: WorkerServiceConfig, parent_pid: int) -> None:
    """The worker child: serve until the parent is gone (even if it was SIGKILLed)."""
    from kvstore.link import make_kv_link
    from worker_svc.service import run_worker, stop_when_parent_exits

    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_worker(config, stop=stop_when_parent_exits(parent_pid), kv_link=make_kv_link)
