"""The pool service over real ZeroMQ worker services around simulated workers (torch-free): one
thread drives every pool, event-driven, so a prefill worker's long iterations never delay the
decode worker's next one."""
from __future__ import annotations

import asyncio
import threading

from prometheus_client import CollectorRegistry

from scheduler_svc.service import run_scheduler
from shared.config import DisaggConfig, SchedulerConfig, SchedulerServiceConfig
from shared.queue import make_queues
from tests.support.sim_pools import SimKvLink
from tests.support.sim_worker import SimWorker, eventually, request
from worker_svc.service import WorkerServer

PREFILL_S, DECODE_S = 0.3, 0.01


class PDService:
    """A prefill and a decode worker service (threads, simulated workers, ipc) and the pool
    service over them; the decode worker can be stopped and started again on its address."""

    def __init__(self, tmp_path, prefill_s=PREFILL_S, decode_s=DECODE_S, **sched):
        self.gq, sq = make_queues(None)
        self.fabric, self.tmp, self.decode_s = {}, tmp_path, decode_s
        self.stop = threading.Event()
        self.prefill = self._serve("prefill", SimWorker(delay_s=prefill_s))
        self.decode = self._serve("decode", SimWorker(delay_s=decode_s))
        ready, self.svc = threading.Event(), []
        config = SchedulerServiceConfig(
            SchedulerConfig(**{**dict(max_num_seqs=8, token_budget=8, watermark=0.0), **sched}),
            worker_addrs=[], metrics_port=None, worker_restart_timeout_s=30,
            disagg=DisaggConfig([self.prefill[0].address], [self.decode[0].address], mode="all"))
        self.sched = threading.Thread(target=run_scheduler, args=(config,), daemon=True, kwargs=dict(
            queue=sq, registry=CollectorRegistry(), stop=self.stop,
            on_ready=lambda s: (self.svc.append(s), ready.set())))
        self.sched.start()
        assert ready.wait(10)
        self.gq.gateway_id = "gw"

    def _serve(self, role, worker):
        stop = threading.Event()
        server = WorkerServer(worker, f"ipc://{self.tmp}/{role}.sock", role=role,
                              kv_link=SimKvLink(worker, self.fabric, f"sim://{role}" if role == "decode" else None))
        t = threading.Thread(target=server.serve_forever, args=(stop,), daemon=True)
        t.start()
        return server, stop, t

    def stop_decode(self):
        server, stop, t = self.decode
        stop.set()
        t.join(5)
        server.close()        # the link drops: the scheduler sees the worker gone

    def start_decode(self):
        self.decode = self._serve("decode", SimWorker(delay_s=self.decode_s))

    @property
    def snapshot(self):
        return self.svc[0].stats_json()

    def close(self):
        self.stop.set()
        self.sched.join(10)
        for server, stop, t in (self.prefill, self.decode):
            stop.set()
            t.join(5)
            server.close()


def all_free(pd) -> bool:
    return all(p["num_free_blocks"] == p["num_total_blocks"] and p["reserved"] == 0
               for p in pd.snapshot["pools"])


def test_a_long_prefill_iteration_does_not_delay_the_decode_worker(tmp_path):
    pd = PDService(tmp_path)
    try:
        short = request("short", 6, max_tokens=40)
        long = request("long", 80, max_tokens=2)        # 10 prefill chunks of 8 tokens: ~3 s

        async def run():
            await pd.gq.submit(short)
            times, events = [], {}
            async for ev in pd.gq.events():
                events.setdefault(ev.req_id, []).append(ev)
                if ev.req_id == "short":
                    times.append(asyncio.get_running_loop().time())
                    if ev.index == 2:
                        await pd.gq.submit(long)           # from now on the prefill worker is busy
                if all(events.get(r) and events[r][-1].finish_reason for r in ("short", "long")):
                    return times, events
        times, events = asyncio.run(asyncio.wait_for(run(), 60))
        gaps = [b - a for a, b in zip(times[3:], times[4:])]
        assert max(gaps) < PREFILL_S / 2, f"decode gaps {max(gaps):.3f} s while the prefill worker was busy"
        assert [e.index for e in events["short"]] == list(range(40))
        assert eventually(lambda: all_free(pd))
        assert [t["req_id"] for t in pd.snapshot["kv_transfers"]] == ["short", "long"]
    finally:
        pd.close()


def test_a_decode_worker_that_goes_away_costs_a_recompute_and_its_return_takes_handoffs_again(tmp_path):
    pd = PDService(tmp_path, prefill_s=0.01, decode_s=0.01)
    try:
        reqs = [request(f"r{i}", 6 + i, max_tokens=30) for i in range(4)]
        again = request("again", 8, max_tokens=4)

        async def run():
            events, phase = {}, 1
            for r in reqs:
                await pd.gq.submit(r)
            async for ev in pd.gq.events():
                events.setdefault(ev.req_id, []).append(ev)
                if ev.req_id == "r0" and ev.index == 5:
                    pd.stop_decode()                       # while it decodes the handed-off requests
                if phase == 1 and all(events.get(r.req_id) and events[r.req_id][-1].finish_reason for r in reqs):
                    phase = 2
                    assert pd.snapshot["num_pools_lost"] == 1
                    pd.start_decode()
                    for _ in range(100):
                        if all(p["up"] for p in pd.snapshot["pools"]):
                            break
                        await asyncio.sleep(0.1)
                    await pd.gq.submit(again)
                if events.get("again") and events["again"][-1].finish_reason:
                    return events
        events = asyncio.run(asyncio.wait_for(run(), 60))
        for r in reqs:   # every token once, in order, though the decode worker's KV was lost
            assert [e.index for e in events[r.req_id]] == list(range(30))
            assert events[r.req_id][-1].finish_reason == "length"
        assert [e.index for e in events["again"]] == [0, 1, 2, 3]
        assert pd.snapshot["kv_transfers"][-1]["req_id"] == "again"   # the returned worker took it
        assert eventually(lambda: all_free(pd))
    finally:
        pd.close()
