"""The scheduler service against a pipeline-parallel replica, torch-free: two ZeroMQ worker
services around the simulated executor play the two stages of a PP=2 replica (stage 0 samples
nothing). The service, given rank 0's address only, finds rank 1, keeps two micro-batches in
flight, produces the tokens a single worker produces, and fails every in-flight request (and
nothing else) when a rank fails a batch."""
from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.scheduler import Scheduler
from shared.config import CacheConfig, SchedulerConfig, SchedulerServiceConfig, rank_address
from shared.messages import BatchOutput
from shared.queue import make_queues
from tests.support.sim_worker import SimWorker, ThreadedStack, collect, request
from worker_svc.service import WorkerServer


class Stage(SimWorker):
    """One stage of a simulated PP=2 replica: every stage writes its KV; only the last samples."""

    def __init__(self, rank: int, **kw):
        super().__init__(**kw)
        self.rank = rank
        self.parallel_info = {"rank": rank, "world_size": 2, "tp": 1, "pp": 2}

    def execute(self, batch):
        out = super().execute(batch)
        return out if self.rank == 1 else BatchOutput(out.batch_id, {}, out.timings)


class Replica(ThreadedStack):
    def __init__(self, tmp_path, stages):
        self.address = f"ipc://{tmp_path}/pp.sock"
        config = SchedulerServiceConfig(SchedulerConfig(max_num_seqs=8, token_budget=16),
                                        worker_addrs=[self.address], metrics_port=None)
        super().__init__([WorkerServer(s, rank_address(self.address, s.rank)) for s in stages], config)


def test_service_pipelines_two_micro_batches_and_gives_the_single_worker_tokens(tmp_path):
    reqs = [request(f"r{i}", prompt_len=12 + 3 * i, max_tokens=6) for i in range(6)]
    rep = Replica(tmp_path, [Stage(0), Stage(1)])
    try:
        svc = rep.service
        assert svc.engine.depth == 2
        svc.engine.record = True
        events = asyncio.run(collect(rep.gq, reqs))
        trace = svc.engine.trace
    finally:
        rep.close()
    got = {r: [e.token_id for e in evs if e.token_id is not None] for r, evs in events.items()}
    # the single-worker reference: one synchronous engine loop over the simulated executor
    info = SimWorker.model_info
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, token_budget=16, max_model_len=info.max_model_len),
                      CacheConfig(info.block_size, info.num_blocks), info)
    outs = EngineLoop(sched, SimWorker()).generate([r.prompt_token_ids for r in reqs],
                                                   [r.sampling for r in reqs])
    assert got == {r.req_id: o.output_token_ids for r, o in zip(reqs, outs)}
    assert all(len(t) == 6 for t in got.values())
    assert max(len(e["in_flight"]) for e in trace) == 1
    for e in trace:
        others = {r for b in trace if b["batch_id"] in e["in_flight"] for r in b["req_ids"]}
        assert not others & set(e["req_ids"])


def test_a_failing_rank_fails_the_requests_of_every_batch_in_flight_and_service_goes_on(tmp_path):
    rep = Replica(tmp_path, [Stage(0), Stage(1, fail_batches={4})])
    try:
        rep.service.engine.record = True

        async def before_and_after():
            first = await collect(rep.gq, [request(f"r{i}", prompt_len=20, max_tokens=8) for i in range(4)])
            return first, await collect(rep.gq, [request("later", max_tokens=3)])

        events, after = asyncio.run(before_and_after())
        trace = rep.service.engine.trace
        lost = next(e for e in trace if e["batch_id"] == 4)
        in_flight = set(lost["req_ids"]) | {r for e in trace if e["batch_id"] in lost["in_flight"]
                                            for r in e["req_ids"]}
        failed = {r for r, evs in events.items() if evs[-1].finish_reason == "error"}
        assert failed == in_flight and failed
        assert all("simulated device error" in events[r][-1].error for r in failed)
        # the next requests run normally (a new epoch re-sends everything in full)
        assert after["later"][-1].finish_reason == "length"
    finally:
        rep.close()


def test_a_lost_rank_during_collect_holds_and_replays_the_requests_of_every_micro_batch():
    """Plumbing (simulated executor behind submit/collect): WorkerLostError out of collect() takes
    issue 10's hold-and-replay path, not the fail path: every request of the micro-batches in
    flight is preempted with its tokens, nothing runs until a worker answers, then they finish
    with the tokens an uninterrupted run gives."""
    from collections import deque

    from scheduler_svc.metrics import SchedulerMetrics
    from scheduler_svc.remote_executor import WorkerLostError
    from scheduler_svc.request import RequestStatus
    from scheduler_svc.service import SchedulerService, loop_engine
    from scheduler_svc.sim_executor import sim_engine
    from shared.sampling import SamplingParams

    class TwoStages:
        """submit/collect over the simulated executor; the first collect with two micro-batches
        in flight once a request has generated tokens loses a rank."""
        parallel = {"rank": 0, "world_size": 2, "tp": 1, "pp": 2}
        pipeline_depth = 2

        def __init__(self, executor):
            self.executor, self.lost = executor, False
            self.queued, self.waited = deque(), 0

        def submit(self, batch):
            self.queued.append(batch)

        def collect(self):
            if not self.lost and len(self.queued) == 2 and any(r.num_output_tokens for r in reqs):
                self.lost = True
                self.queued.clear()
                raise WorkerLostError("worker ipc://x.rank1 disconnected: its KV cache is lost")
            batch = self.queued.popleft()
            return batch, self.executor.execute(batch)

        def wait_ready(self, timeout_s):
            self.waited += 1

    params = SamplingParams(temperature=0.0, max_tokens=6)
    prompts = [list(range(3 + i, 20 + 2 * i)) for i in range(6)]
    ref = sim_engine("sarathi", block_size=4, num_blocks=64, token_budget=16).generate(prompts, params)
    loop = sim_engine("sarathi", block_size=4, num_blocks=64, token_budget=16)
    reqs = [loop.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    fake = TwoStages(loop.executor)
    metrics = SchedulerMetrics(CollectorRegistry())
    service = SchedulerService(loop_engine(loop.scheduler, fake, metrics), make_queues(None)[1], metrics)
    assert service.engine.depth == 2
    events = []
    for _ in range(40):                            # until a collect with two in flight loses a rank
        events += service._step()
        if fake.lost:
            break
    assert fake.lost
    assert not [e for e in events if e.finish_reason]
    assert not service.worker_up and not service.engine.in_flight
    assert any(r.status is RequestStatus.PREEMPTED and r.num_output_tokens > 0 for r in reqs)
    assert all(not r.in_flight and r.num_computed_tokens == 0 for r in reqs)
    service.engine.wait_for_worker()               # a worker answers: run them again
    assert service.worker_up and fake.waited == 1
    while loop.scheduler.has_unfinished():
        events += service._step()
    assert [r.output_token_ids for r in reqs] == [o.output_token_ids for o in ref]
    assert {e.req_id for e in events if e.finish_reason == "length"} == {r.req_id for r in reqs}
