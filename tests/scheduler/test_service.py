"""The scheduler service's plumbing, torch-free: the in-process queue, a real ZeroMQ worker
service around the simulated executor (scheduler_svc.sim_executor), and the service loop in a
thread. What is tested is the service (admission, events, acks, aborts, failures, replay,
metrics), not the model, hence the simulated worker."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from scheduler_svc.service import run_scheduler
from shared.config import SchedulerConfig, SchedulerServiceConfig
from shared.messages import RequestMsg
from shared.queue import make_queues
from shared.sampling import SamplingParams
from tests.support.sim_worker import NUM_BLOCKS, SimWorker, ThreadedStack, collect, eventually, request
from worker_svc.service import WorkerServer


class Stack(ThreadedStack):
    """Worker service + scheduler service (thread each) + the gateway side of the queue."""

    def __init__(self, tmp_path, worker: SimWorker, queues=None, name="sim"):
        self.server = WorkerServer(worker, f"ipc://{tmp_path}/{name}.sock")
        super().__init__([self.server], SchedulerServiceConfig(
            SchedulerConfig(max_num_seqs=8, token_budget=16), worker_addrs=[self.server.address],
            metrics_port=0, metrics_host="127.0.0.1"), queues=queues)


@pytest.fixture
def stack(tmp_path):
    made = []

    def make(worker=None, queues=None):
        made.append(Stack(tmp_path, worker or SimWorker(), queues, name=f"w{len(made)}"))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_requests_stream_indexed_tokens_and_are_acked_when_finished(stack):
    s = stack()
    events = asyncio.run(collect(s.gq, [request(f"r{i}", 5 + i, max_tokens=4 + i) for i in range(6)]))
    for i in range(6):
        evs = events[f"r{i}"]
        assert [e.index for e in evs] == list(range(4 + i))
        assert evs[-1].finish_reason == "length" and all(e.token_id is not None for e in evs)
    assert eventually(lambda: s.gq.broker.pending == {})


def test_an_invalid_request_gets_an_error_event_and_is_acked(stack):
    s = stack()
    events = asyncio.run(collect(s.gq, [request("long", prompt_len=90, max_tokens=10)]))
    (ev,) = events["long"]
    assert ev.finish_reason == "error" and "context length" in ev.error and ev.index == 0
    assert eventually(lambda: s.gq.broker.pending == {})


def test_an_aborted_request_ends_with_an_abort_event_and_frees_its_blocks(stack):
    s = stack(SimWorker(delay_s=0.01))

    async def abort_after_two(ev):
        if ev.index == 1:
            await s.gq.abort("victim")

    events = asyncio.run(collect(s.gq, [request("victim", max_tokens=60)], on_event=abort_after_two))
    assert events["victim"][-1].finish_reason == "abort"
    assert eventually(lambda: s.service.snapshot["num_free_blocks"] == NUM_BLOCKS)
    assert eventually(lambda: s.gq.broker.pending == {})


def test_a_failed_iteration_errors_its_requests_and_the_service_keeps_serving(stack):
    s = stack(SimWorker(fail_batches={2}))

    async def both():  # one event loop: the in-process queue binds to the first one
        return (await collect(s.gq, [request("a", max_tokens=8)]),
                await collect(s.gq, [request("b", max_tokens=3)]))

    events, later = asyncio.run(both())
    assert events["a"][-1].finish_reason == "error" and "simulated device error" in events["a"][-1].error
    assert [e.index for e in later["b"]] == [0, 1, 2] and later["b"][-1].finish_reason == "length"


def test_an_inconsistent_reply_fails_the_requests_instead_of_hanging_them(stack):
    s = stack(SimWorker(drop_tokens_on={3}))

    async def both():  # one event loop: the in-process queue binds to the first one
        return (await collect(s.gq, [request("a", max_tokens=8), request("b", max_tokens=8)]),
                await collect(s.gq, [request("c", max_tokens=3)]))

    events, later = asyncio.run(both())
    for r in ("a", "b"):
        assert events[r][-1].finish_reason == "error" and "internal error" in events[r][-1].error
    assert later["c"][-1].finish_reason == "length"
    assert eventually(lambda: s.service.snapshot["num_free_blocks"] == NUM_BLOCKS)


def test_a_restarted_scheduler_replays_unfinished_requests_with_the_same_tokens(stack):
    reference = asyncio.run(collect(stack().gq, [request("x", max_tokens=30)]))["x"]
    queues = make_queues(None)
    first = stack(SimWorker(delay_s=0.02), queues)

    async def stop_midway(ev):
        if ev.index == 5:
            first.stop.set()  # the loop exits without acking: "x" stays pending
            return True

    async def crash_and_restart():  # one event loop: the in-process queue binds to the first one
        seen = (await collect(queues[0], [request("x", max_tokens=30)], on_event=stop_midway))["x"]
        first.close()
        assert "x" in queues[0].broker.pending and seen[-1].finish_reason is None
        stack(SimWorker(), queues)
        return seen, (await collect(queues[0], [], expect=["x"]))["x"]

    seen, replayed = asyncio.run(crash_and_restart())
    assert replayed[-1].finish_reason == "length"
    by_index = {}
    for ev in seen + replayed:  # duplicates by index must carry the same token
        assert by_index.setdefault(ev.index, ev.token_id) == ev.token_id
    assert [by_index[i] for i in range(30)] == [e.token_id for e in reference]
    assert eventually(lambda: queues[0].broker.pending == {})


class FailsWhileStopping(SimWorker):
    """Fails batch `at` after setting `stop` (once the scheduler waits for that batch: it must
    see the failure, not stop before it): the worker going away as its replica stops."""

    def __init__(self, at: int, **kw):
        super().__init__(fail_batches={at}, **kw)
        self.at, self.stop = at, None

    def execute(self, batch):
        if batch.batch_id == self.at:
            time.sleep(0.2)
            self.stop.set()
        return super().execute(batch)


def test_an_iteration_failing_while_the_replica_stops_leaves_its_requests_for_replay(stack):
    queues = make_queues(None)
    worker = FailsWhileStopping(at=6, delay_s=0.01)
    first = stack(worker, queues)
    worker.stop = first.stop

    async def stop_and_restart():  # one event loop: the in-process queue binds to the first one
        task = asyncio.ensure_future(collect(queues[0], [request("x", max_tokens=20)], timeout=20))
        assert await asyncio.to_thread(first.stop.wait, 10)
        await asyncio.to_thread(first.close)
        # the failed iteration's "error" is withheld: nobody told the client it failed
        assert "x" in queues[0].broker.pending
        assert first.service.metrics.failed_iterations._value.get() == 1
        stack(SimWorker(), queues)
        return await task

    events = asyncio.run(stop_and_restart())["x"]
    assert all(e.finish_reason != "error" for e in events)
    assert events[-1].finish_reason == "length"
    assert sorted({e.index for e in events}) == list(range(20))
    assert eventually(lambda: queues[0].broker.pending == {})


def test_metrics_health_ready_and_stats_are_served_over_http(stack):
    s = stack()
    asyncio.run(collect(s.gq, [request("m", max_tokens=3)]))
    port = s.service.http_port

    def get(path: str) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}").read().decode()

    assert get("/health") == "ok" and get("/ready") == "ready"
    assert json.loads(get("/stats"))["num_total_blocks"] == NUM_BLOCKS
    finished = 'sarathi_scheduler_requests_finished_total{reason="length"} 1.0'
    assert eventually(lambda: finished in get("/metrics"))  # counted just after the publish
    text = get("/metrics")
    for name in ("sarathi_scheduler_running_requests", "sarathi_scheduler_waiting_requests",
                 "sarathi_scheduler_kv_cache_usage_ratio", "sarathi_scheduler_preemptions_total",
                 "sarathi_scheduler_iteration_seconds_bucket",
                 'sarathi_scheduler_iteration_tokens_count{kind="decode"}',
                 'sarathi_scheduler_tokens_total{kind="prefill"} 10.0',
                 'sarathi_scheduler_tokens_total{kind="decode"} 2.0',
                 'sarathi_scheduler_policy_info{policy="sarathi"} 1.0',
                 "sarathi_scheduler_token_budget 16.0",
                 'sarathi_scheduler_requests_finished_total{reason="length"} 1.0'):
        assert name in text, name


def test_health_answers_while_the_workers_load_and_ready_only_once_they_answer(tmp_path):
    from tests.support.redis_fixture import free_port

    port, stop = free_port(), threading.Event()
    _, sq = make_queues(None)
    config = SchedulerServiceConfig(worker_addrs=[f"ipc://{tmp_path}/not-yet.sock"], metrics_port=port,
                                    metrics_host="127.0.0.1")
    t = threading.Thread(target=run_scheduler, args=(config,), daemon=True, kwargs=dict(
        queue=sq, registry=CollectorRegistry(), stop=stop))
    t.start()
    url, server = f"http://127.0.0.1:{port}", None
    try:
        assert eventually(lambda: _status(url + "/health") == 200)
        assert _status(url + "/ready") == 503
        server = WorkerServer(SimWorker(), f"ipc://{tmp_path}/not-yet.sock")  # the worker comes up
        threading.Thread(target=server.serve_forever, args=(stop,), daemon=True).start()
        assert eventually(lambda: _status(url + "/ready") == 200)
    finally:
        stop.set()
        t.join(10)
        if server is not None:
            server.close()


def _status(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=2).status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def test_a_restarted_worker_replays_the_running_requests_and_forgets_cached_prefixes():
    """Plumbing only (simulated executor): the service's reaction to WorkerRestartedError: the
    running request is preempted with its tokens, recomputed, and ends as if never interrupted."""
    from prometheus_client import CollectorRegistry

    from scheduler_svc.metrics import SchedulerMetrics
    from scheduler_svc.remote_executor import WorkerRestartedError
    from scheduler_svc.request import RequestStatus
    from scheduler_svc.service import SchedulerService, loop_engine
    from scheduler_svc.sim_executor import sim_engine

    loop = sim_engine("sarathi", block_size=4, num_blocks=32, enable_prefix_caching=True)
    prompt = list(range(1, 18))
    loop.add_request("done", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    loop.run_until_done()                         # its full prompt blocks are now cached
    running = loop.add_request("running", list(range(40, 50)), SamplingParams(temperature=0.0, max_tokens=5))
    loop.step()
    loop.step()
    assert running.num_output_tokens == 2

    class Restarted:
        def execute(self, batch):
            raise WorkerRestartedError("worker restarted")

    metrics = SchedulerMetrics(CollectorRegistry())
    service = SchedulerService(loop_engine(loop.scheduler, Restarted(), metrics), make_queues(None)[1], metrics)
    events = service._step()
    assert [e for e in events if e.finish_reason] == []
    assert running.status is RequestStatus.PREEMPTED and running.num_computed_tokens == 0
    assert running.num_output_tokens == 2 and not running.in_flight
    loop.run_until_done()                         # the real executor again: recomputed, resumed
    ref = sim_engine("sarathi", block_size=4, num_blocks=32).generate(
        [list(range(40, 50))], SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert running.finish_reason == "length" and running.output_token_ids == ref.output_token_ids
    hits_before = loop.scheduler.stats()["prefix_cache_hit_tokens"]
    loop.add_request("again", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    loop.run_until_done()                         # same prompt as "done": recomputed, not reused
    assert loop.scheduler.stats()["prefix_cache_hit_tokens"] == hits_before


def test_events_wait_in_order_while_the_queue_is_down_and_nothing_is_lost():
    """Plumbing (simulated executor, in-process queue that refuses while `down`): the loop keeps
    running, the events go out in order once the queue answers, each request is acked once."""
    from scheduler_svc.metrics import SchedulerMetrics
    from scheduler_svc.service import SchedulerService, loop_engine
    from scheduler_svc.sim_executor import sim_engine
    from shared.queue import QueueUnavailableError

    gq, sq = make_queues(None)
    published, acked = [], []

    class Flaky:
        down = False

        def __getattr__(self, name):
            attr = getattr(sq, name)
            if name in ("publish", "ack", "poll_aborts", "fetch") and callable(attr):
                def call(*a, **kw):
                    if self.down:
                        raise QueueUnavailableError("Redis unavailable: test")
                    if name == "publish":
                        published.extend((e.req_id, e.index, e.finish_reason) for e in a[0])
                    if name == "ack":
                        acked.append(a[0])
                    return attr(*a, **kw)
                return call
            return attr

    loop = sim_engine("sarathi", block_size=4, num_blocks=64)
    flaky = Flaky()
    metrics = SchedulerMetrics(CollectorRegistry())
    service = SchedulerService(loop_engine(loop.scheduler, loop.executor, metrics), flaky, metrics)
    asyncio.run(gq.submit(RequestMsg("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6), gq.gateway_id,
                                     time.time())))
    service.run_once()
    service.run_once()
    flaky.down = True
    for _ in range(10):               # it finishes while nobody can be told
        service.run_once()
    assert not loop.scheduler.has_unfinished() and acked == []
    flaky.down = False
    service.run_once()
    assert [i for r, i, _ in published if r == "r"] == list(range(6))
    assert published[-1][2] == "length" and acked == ["r"]


def test_the_next_batch_goes_to_the_worker_before_the_step_s_tokens_are_published(stack):
    """The worker computes batch n + 1 while the service publishes batch n's tokens: for a
    request decoding alone, token k is the output of batch k, and batch k + 1 reaches the worker
    before token k is handed to the queue (the publish made slow here, 30 ms)."""
    started = {}

    class Timed(SimWorker):
        def execute(self, batch):
            started[batch.batch_id] = time.monotonic()
            return super().execute(batch)

    s = stack(Timed(delay_s=0.01))
    published = {}
    publish = s.sq.publish

    def slow_publish(events, reply_to):
        for e in events:
            if e.token_id is not None:
                published[e.index] = time.monotonic()
        time.sleep(0.03)
        return publish(events, reply_to)
    s.sq.publish = slow_publish
    events = asyncio.run(collect(s.gq, [request("solo", prompt_len=5, max_tokens=8)]))
    assert [e.index for e in events["solo"]] == list(range(8))
    # batch 0 is the prompt (token 0); batch k + 1 computes token k + 1 from token k, and starts
    # on the worker while token k's 30 ms publish is under way (before: only after it)
    ahead = [k for k in range(7) if started[k + 1] < published[k] + 0.015]
    assert len(ahead) == 7, (started, published)
