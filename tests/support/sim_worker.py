"""A simulated worker for the scheduler service's tests (torch-free): the simulated executor
with what a worker service needs, and the requests / event collection those tests share."""
from __future__ import annotations

import asyncio
import time

from scheduler_svc.sim_executor import SimExecutor
from shared.config import ModelInfo
from shared.messages import RequestMsg
from shared.sampling import SamplingParams

BLOCK, NUM_BLOCKS = 4, 64


class SimWorker(SimExecutor):
    """The simulated executor with what a worker service needs: model_info, free(), and an
    optional failure on a chosen batch id."""

    model_info = ModelInfo("sim", max_model_len=96, vocab_size=500, eos_token_ids=[0],
                           block_size=BLOCK, num_blocks=NUM_BLOCKS)

    def __init__(self, fail_batches=(), delay_s: float = 0.0, drop_tokens_on=()):
        super().__init__(BLOCK, vocab_size=500)
        self.fail_batches, self.delay_s = set(fail_batches), delay_s
        self.drop_tokens_on = set(drop_tokens_on)

    def execute(self, batch):
        time.sleep(self.delay_s)
        if batch.batch_id in self.fail_batches:
            raise RuntimeError("simulated device error")
        out = super().execute(batch)
        if batch.batch_id in self.drop_tokens_on:
            out.sampled.clear()  # a broken reply: tokens that were due are missing
        return out

    def free(self, req_ids):
        pass


def eventually(cond, timeout=5.0) -> bool:
    """Acks follow the publish of a request's last event (never the other way round: an acked
    request must have had its end delivered), so a test that saw the end waits for the ack."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def request(req_id, prompt_len=10, max_tokens=5, **sp):
    return RequestMsg(req_id, list(range(1, prompt_len + 1)),
                      SamplingParams(temperature=0.0, max_tokens=max_tokens, **sp),
                      reply_to="gw", arrival_time=time.time())


async def collect(gq, reqs, expect=(), timeout=20.0, on_event=None):
    """Submit `reqs`, gather events until each of them (and of `expect`) ended, or until
    on_event returns True; returns req_id -> events."""
    gq.gateway_id = "gw"
    for r in reqs:
        await gq.submit(r)
    events = {r: [] for r in [q.req_id for q in reqs] + list(expect)}

    async def gather():
        async for ev in gq.events():
            events.setdefault(ev.req_id, []).append(ev)
            if on_event is not None and await on_event(ev):
                return
            if all(e and e[-1].finish_reason for e in events.values()):
                return

    await asyncio.wait_for(gather(), timeout)
    return events


class ThreadedStack:
    """Worker services serving on threads and one scheduler service (run_scheduler) over them,
    on an in-process queue (`gq` for the gateway side, `sq` for the scheduler's; or the given
    queues' pair, e.g. one a previous stack used). `service` is
    the scheduler service once it answered ready; a stack that is not ready within ready_s stops
    what it started (so a failed start does not leak into later tests) and fails."""

    def __init__(self, servers: list, config, ready_s: float = 10.0, queues=None):
        import threading

        from prometheus_client import CollectorRegistry

        from scheduler_svc.service import run_scheduler
        from shared.queue import make_queues

        self.gq, self.sq = queues or make_queues(None)
        self.servers = servers
        self.stop = threading.Event()
        self.service = None
        ready = threading.Event()

        def on_ready(svc):
            self.service = svc
            ready.set()

        self.threads = [threading.Thread(target=s.serve_forever, args=(self.stop,), daemon=True)
                        for s in servers]
        self.threads.append(threading.Thread(target=run_scheduler, args=(config,), daemon=True, kwargs=dict(
            queue=self.sq, registry=CollectorRegistry(), stop=self.stop, on_ready=on_ready)))
        for t in self.threads:
            t.start()
        if not ready.wait(ready_s):
            self.close()
            raise AssertionError(f"the scheduler service did not answer ready within {ready_s:g} s")

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)
        for s in self.servers:
            s.close()
