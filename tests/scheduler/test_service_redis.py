"""Scheduler replicas over the real Redis queue, torch-free (the simulated executor behind real
ZeroMQ worker services; this is about the service plumbing): a replica that dies leaves its
requests pending, and another replica claims them (XAUTOCLAIM) and finishes them."""
from __future__ import annotations

import asyncio
import threading

from prometheus_client import CollectorRegistry

from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.remote_executor import RemoteExecutor
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.service import SchedulerService, loop_engine
from shared.config import CacheConfig, SchedulerConfig
from shared.queue import QueueConfig, make_gateway_queue, make_scheduler_queue
from tests.support.sim_worker import BLOCK, NUM_BLOCKS, SimWorker, collect, eventually, request
from worker_svc.service import WorkerServer


class Replica:
    """One scheduler service (consumer `name`) and its own simulated worker, in two threads."""

    def __init__(self, tmp_path, name: str, redis_url: str, cfg: QueueConfig, worker: SimWorker):
        self.server = WorkerServer(worker, f"ipc://{tmp_path}/{name}.sock")
        self.stop, self.server_stop = threading.Event(), threading.Event()
        self.threads = [threading.Thread(target=self.server.serve_forever, args=(self.server_stop,),
                                         daemon=True)]
        self.threads[0].start()
        remote = RemoteExecutor(self.server.address, timeout_s=10)
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, token_budget=16),
                          CacheConfig(BLOCK, NUM_BLOCKS), remote.model_info)
        self.queue = make_scheduler_queue(redis_url, config=cfg, consumer=name)
        metrics = SchedulerMetrics(CollectorRegistry())
        self.service = SchedulerService(loop_engine(sched, remote, metrics), self.queue, metrics,
                                        replay_interval_s=0.2)
        self.threads.append(threading.Thread(target=self.service.run, args=(self.stop,), daemon=True))
        self.threads[1].start()

    def close(self):
        """The scheduler stops first (its batch in flight is answered), then the worker."""
        self.stop.set()
        self.threads[1].join(10)
        self.server_stop.set()
        self.threads[0].join(10)
        self.server.close()
        self.queue.close()


def test_a_dead_replicas_requests_are_claimed_and_finished_by_another(tmp_path, redis_server_url, redis_prefix):
    cfg = QueueConfig(prefix=redis_prefix, claim_min_idle_ms=300, heartbeat_interval_s=0.05)
    reqs = [request(f"q{i}", max_tokens=30) for i in range(4)]
    replicas = []

    async def scenario():
        gq = make_gateway_queue(redis_server_url, config=cfg, gateway_id="gw")
        replicas.append(Replica(tmp_path, "A", redis_server_url, cfg, SimWorker(delay_s=0.02)))

        async def kill_a_midway(ev):
            if ev.index == 3 and not replicas[0].stop.is_set():
                replicas[0].close()  # A stops heartbeating and never acks: a dead replica
                replicas.append(Replica(tmp_path, "B", redis_server_url, cfg, SimWorker()))

        try:
            return await collect(gq, reqs, timeout=30, on_event=kill_a_midway)
        finally:
            await gq.close()

    events = asyncio.run(scenario())
    try:
        assert len(replicas) == 2
        for r in reqs:
            evs = events[r.req_id]
            by_index = {}
            for ev in evs:  # replayed events repeat indices, always with the same token
                assert by_index.setdefault(ev.index, ev.token_id) == ev.token_id
            assert sorted(by_index) == list(range(30)) and evs[-1].finish_reason == "length"
        b = replicas[1]
        def finished():
            return [rep.service.metrics.registry.get_sample_value(
                "sarathi_scheduler_requests_finished_total", {"reason": "length"}) or 0 for rep in replicas]

        assert eventually(lambda: sum(finished()) == len(reqs))  # counted after the publish
        assert finished()[1] >= 1  # B finished what A left
        assert eventually(lambda: b.service.snapshot["num_free_blocks"] == NUM_BLOCKS)
    finally:
        for rep in replicas:
            if not rep.stop.is_set():
                rep.close()
