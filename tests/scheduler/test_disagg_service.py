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


def test_a_long_prefill_iteration_does_not_delay_the_decode_worker(tmp_path):
    gq, sq = make_queues(None)
    fabric: dict = {}
    prefill, decode = SimWorker(delay_s=PREFILL_S), SimWorker(delay_s=DECODE_S)
    servers = [WorkerServer(w, f"ipc://{tmp_path}/{role}.sock", role=role,
                            kv_link=SimKvLink(w, fabric, f"sim://{role}" if role == "decode" else None))
               for role, w in (("prefill", prefill), ("decode", decode))]
    stop, ready = threading.Event(), threading.Event()
    svc: list = []
    config = SchedulerServiceConfig(SchedulerConfig(max_num_seqs=8, token_budget=8, watermark=0.0),
                                    worker_addrs=[], metrics_port=None,
                                    disagg=DisaggConfig([servers[0].address], [servers[1].address], mode="all"))
    threads = [threading.Thread(target=s.serve_forever, args=(stop,), daemon=True) for s in servers]
    threads.append(threading.Thread(target=run_scheduler, args=(config,), daemon=True, kwargs=dict(
        queue=sq, registry=CollectorRegistry(), stop=stop,
        on_ready=lambda s: (svc.append(s), ready.set()))))
    for t in threads:
        t.start()
    try:
        assert ready.wait(10)
        short = request("short", 6, max_tokens=40)
        long = request("long", 80, max_tokens=2)        # 10 prefill chunks of 8 tokens: ~3 s

        async def run():
            gq.gateway_id = "gw"
            await gq.submit(short)
            times, events = [], {}
            async for ev in gq.events():
                events.setdefault(ev.req_id, []).append(ev)
                if ev.req_id == "short":
                    times.append(asyncio.get_running_loop().time())
                    if ev.index == 2:
                        await gq.submit(long)              # from now on the prefill worker is busy
                if all(events.get(r) and events[r][-1].finish_reason for r in ("short", "long")):
                    return times, events
        times, events = asyncio.run(asyncio.wait_for(run(), 60))
        gaps = [b - a for a, b in zip(times[3:], times[4:])]
        assert max(gaps) < PREFILL_S / 2, f"decode gaps {max(gaps):.3f} s while the prefill worker was busy"
        assert [e.index for e in events["short"]] == list(range(40))
        assert eventually(lambda: all(p["num_free_blocks"] == p["num_total_blocks"]
                                      for p in svc[0].snapshot["pools"]))
        assert [t["req_id"] for t in svc[0].stats_json()["kv_transfers"]] == ["short", "long"]
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for s in servers:
            s.close()
