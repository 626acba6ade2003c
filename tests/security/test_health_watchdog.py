"""Health that tells the truth: the scheduler's /health (a real HTTP server) answers 503 once its
loop has not advanced for the stall timeout while it holds a request, and 200 again when the loop
moves; while stalled the replica stops heartbeating, so another replica can claim its work."""
from __future__ import annotations

import asyncio
import threading
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry

from scheduler_svc.service import run_scheduler, stall_timeout
from shared.config import SchedulerConfig, SchedulerServiceConfig
from shared.queue import QueueConfig, make_scheduler_queue
from shared.queue.local import LocalBroker, LocalGatewayQueue
from tests.support.sim_worker import SimWorker, eventually, request

STALL_S = 0.6


class StuckWorker(SimWorker):
    """Blocks in its second batch until `release` is set: a wedged loop."""

    def __init__(self):
        super().__init__()
        self.release, self.stuck = threading.Event(), threading.Event()

    def execute(self, batch):
        if batch.batch_id == 1:
            self.stuck.set()
            self.release.wait(30)
        return super().execute(batch)


def _health(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_stuck_loop_fails_health_and_lets_its_request_go():
    cfg = QueueConfig(claim_min_idle_ms=300, heartbeat_interval_s=0.05)
    broker = LocalBroker(cfg)
    gq = LocalGatewayQueue(broker, "gw")
    sq = make_scheduler_queue(None, config=cfg, consumer="wedged", broker=broker)
    worker = StuckWorker()
    stop, ready, services = threading.Event(), threading.Event(), []
    config = SchedulerServiceConfig(SchedulerConfig(max_num_seqs=8, token_budget=16), metrics_port=0,
                                    metrics_host="127.0.0.1", worker_timeout_s=STALL_S / 2, stall_timeout_s=STALL_S)
    thread = threading.Thread(target=run_scheduler, args=(config,), daemon=True, kwargs=dict(
        queue=sq, executor=worker, registry=CollectorRegistry(), stop=stop,
        on_ready=lambda svc: (services.append(svc), ready.set())))
    thread.start()
    try:
        assert ready.wait(10)
        port = services[0].http_port
        assert _health(port) == (200, "ok")
        asyncio.run(gq.submit(request("r", max_tokens=5)))
        assert worker.stuck.wait(5)
        assert _health(port)[0] == 200  # a long batch is not yet a stall
        assert eventually(lambda: _health(port)[0] == 503, 5)
        status, reason = _health(port)
        assert "stalled" in reason and "Traceback" not in reason
        other = make_scheduler_queue(None, config=cfg, consumer="other", broker=broker)
        assert eventually(lambda: [m.req_id for m in other.replay_pending()] == ["r"], 3)
        worker.release.set()
        assert eventually(lambda: _health(port) == (200, "ok"), 5)
    finally:
        worker.release.set()
        stop.set()
        thread.join(10)


def test_the_stall_timeout_never_undercuts_a_legitimate_batch():
    assert stall_timeout(SchedulerServiceConfig(worker_timeout_s=120.0)) == 180.0
    assert stall_timeout(SchedulerServiceConfig(worker_timeout_s=120.0, stall_timeout_s=300.0)) == 300.0
    assert stall_timeout(SchedulerServiceConfig(worker_timeout_s=120.0, stall_timeout_s=30.0)) == 120.0
