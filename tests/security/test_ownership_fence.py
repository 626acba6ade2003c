"""Exactly one runner per request, on real Redis (and the in-process queue where the rule is
the queue's): a replica busy in one long batch keeps its requests (its heartbeat does not depend
on its loop); a request claimed from a stalled replica streams the new owner's events only (the
owner/epoch fence, on both the scheduler and the gateway side); a gateway that died has its
requests aborted instead of run to max_tokens."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import redis
from prometheus_client import CollectorRegistry

from scheduler_svc.service import run_scheduler
from shared.config import SchedulerConfig, SchedulerServiceConfig
from shared.messages import TokenEvent
from shared.queue import QueueConfig, make_gateway_queue, make_queues, make_scheduler_queue
from shared.queue.local import LocalBroker
from tests.support.sim_worker import SimWorker, eventually, request

CLAIM_IDLE_MS = 300


class Scheduler:
    """run_scheduler on a thread over a simulated worker (no ZeroMQ: what is tested is the
    service's liveness against the queue, not the link)."""

    def __init__(self, queue, worker: SimWorker):
        self.stop, self.ready = threading.Event(), threading.Event()
        config = SchedulerServiceConfig(SchedulerConfig(max_num_seqs=8, token_budget=16), metrics_port=None)
        self.thread = threading.Thread(target=run_scheduler, args=(config,), daemon=True, kwargs=dict(
            queue=queue, executor=worker, registry=CollectorRegistry(), stop=self.stop,
            on_ready=lambda _svc: self.ready.set()))
        self.thread.start()
        assert self.ready.wait(10)

    def close(self):
        self.stop.set()
        self.thread.join(10)


def _out_events(r: redis.Redis, cfg: QueueConfig, gw: str) -> list[dict]:
    return [e for _, f in r.xrange(cfg.out_key(gw)) for e in json.loads(f["events"])]


def test_a_replica_busy_in_a_long_batch_keeps_its_request(redis_server_url, redis_prefix):
    """The first batch takes 3x the claim idle time; another replica polling for dead replicas'
    work all along gets nothing, and the request ends with one run's tokens, all at epoch 1."""
    cfg = QueueConfig(prefix=redis_prefix, claim_min_idle_ms=CLAIM_IDLE_MS, heartbeat_interval_s=0.05)
    gq, sq = make_queues(redis_server_url, config=cfg, gateway_id="gw", consumer="busy")
    other = make_scheduler_queue(redis_server_url, config=cfg, consumer="other")
    worker = SimWorker(delay_s=3 * CLAIM_IDLE_MS / 1000)
    sched = Scheduler(sq, worker)
    r = redis.Redis.from_url(redis_server_url, decode_responses=True)
    loop = asyncio.new_event_loop()  # the gateway side's connections belong to one loop
    try:
        loop.run_until_complete(gq.submit(request("r", max_tokens=2)))
        deadline = time.monotonic() + 2 * 3 * CLAIM_IDLE_MS / 1000
        claimed = []
        while time.monotonic() < deadline:  # two long batches: prefill, then the decode
            claimed += other.replay_pending()
            time.sleep(0.05)
        assert claimed == []
        assert eventually(lambda: any(e["finish_reason"] for e in _out_events(r, cfg, "gw")))
        evs = _out_events(r, cfg, "gw")
        assert [(e["index"], e["epoch"]) for e in evs] == [(0, 1), (1, 1)]
    finally:
        sched.close()
        other.close()
        loop.run_until_complete(gq.close())
        loop.close()


@pytest.fixture(params=["local", "redis"])
def sides(request):
    """(gateway queue, scheduler-side maker, the gateway side's loop) over the in-process broker or real Redis."""
    if request.param == "redis":
        url, prefix = request.getfixturevalue("redis_server_url"), request.getfixturevalue("redis_prefix")
    else:
        url, prefix = None, "local:"
    cfg = QueueConfig(prefix=prefix, claim_min_idle_ms=CLAIM_IDLE_MS, heartbeat_interval_s=0.05)
    broker = None if url else LocalBroker(cfg)
    made = []

    def scheduler(name):
        made.append(make_scheduler_queue(url, config=cfg, consumer=name, broker=broker))
        return made[-1]

    gq = make_gateway_queue(url, config=cfg, gateway_id="gw", broker=broker)
    loop = asyncio.new_event_loop()  # the gateway side's connections belong to one loop
    yield gq, scheduler, loop
    for q in made:
        q.close()
    loop.run_until_complete(gq.close())
    loop.close()


def test_a_claimed_request_streams_only_its_new_owners_events(sides):
    gq, scheduler, loop = sides
    a, b = scheduler("a"), scheduler("b")

    async def main():
        stream = gq.events()
        seen = []

        async def take(n):
            for _ in range(n):
                seen.append(await asyncio.wait_for(anext(stream), 5))

        await gq.submit(request("r", max_tokens=4))
        assert [m.req_id for m in a.fetch(1)] == ["r"]
        a.publish([TokenEvent("r", 0, 100)])
        await take(1)
        await asyncio.sleep(CLAIM_IDLE_MS / 1000 + 0.1)  # "a" stalls: no heartbeat
        assert [m.req_id for m in b.replay_pending()] == ["r"]
        a.heartbeat()  # "a" wakes up: it must not take the request back
        assert a.take_lost() == ["r"]
        assert [m.req_id for m in b.replay_pending()] == ["r"]  # b's own replay: same epoch
        a.publish([TokenEvent("r", 1, 101)])  # a late event of the old run: not sent
        b.publish([TokenEvent("r", i, 200 + i) for i in range(3)])
        await take(3)
        b.publish([TokenEvent("r", 3, 203, "length")])
        await take(1)
        await stream.aclose()
        return seen

    seen = loop.run_until_complete(main())
    assert [(e.index, e.token_id, e.epoch) for e in seen] == [
        (0, 100, 1), (0, 200, 2), (1, 201, 2), (2, 202, 2), (3, 203, 2)]
    assert a.take_lost() == []
    assert [m.req_id for m in a.replay_pending()] == []  # not idle: b heartbeats it
    b.ack("r")


def test_the_gateway_drops_a_former_owners_events_that_raced_past_the_scheduler_side(
        redis_server_url, redis_prefix):
    """What the server-side check cannot stop (an event already in the reply stream when the
    claim happened, or a forged one): once epoch 2 was seen, epoch-1 events are not delivered."""
    cfg = QueueConfig(prefix=redis_prefix)
    gq = make_gateway_queue(redis_server_url, config=cfg, gateway_id="gw")
    r = redis.Redis.from_url(redis_server_url, decode_responses=True)

    def put(*evs):
        r.xadd(cfg.out_key("gw"), {"events": json.dumps([e.to_wire() for e in evs])})

    async def main():
        stream = gq.events()
        put(TokenEvent("r", 0, 1, epoch=1), TokenEvent("r", 0, 2, epoch=2))
        put(TokenEvent("r", 1, 3, epoch=1), TokenEvent("r", 1, 4, epoch=2), TokenEvent("q", 0, 5, epoch=1))
        got = [await asyncio.wait_for(anext(stream), 5) for _ in range(4)]
        await stream.aclose()
        await gq.close()
        return got

    got = asyncio.run(main())
    assert [(e.req_id, e.token_id) for e in got] == [("r", 1), ("r", 2), ("r", 4), ("q", 5)]
    assert gq.fenced == 1


def test_the_requests_of_a_dead_gateway_are_aborted_not_run_to_max_tokens(redis_server_url, redis_prefix):
    """The gateway submits and dies (its lease is not renewed): the scheduler aborts the request
    within a few lease checks and acks it, long before its 80 tokens."""
    cfg = QueueConfig(prefix=redis_prefix, gateway_ttl_s=0.3, heartbeat_interval_s=0.05)
    gq, sq = make_queues(redis_server_url, config=cfg, gateway_id="gw-dead", consumer="s")
    sched = Scheduler(sq, SimWorker(delay_s=0.03))
    r = redis.Redis.from_url(redis_server_url, decode_responses=True)
    loop = asyncio.new_event_loop()
    try:
        req = request("r", max_tokens=80)
        req.reply_to = "gw-dead"
        loop.run_until_complete(gq.submit(req))  # the last sign of life of this gateway
        assert eventually(lambda: any(e["finish_reason"] for e in _out_events(r, cfg, "gw-dead")), 10)
        evs = _out_events(r, cfg, "gw-dead")
        assert evs[-1]["finish_reason"] == "abort" and len(evs) < 60
        assert eventually(lambda: r.xlen(cfg.requests_key) == 0)  # acked: nobody replays it
    finally:
        sched.close()
        loop.run_until_complete(gq.close())
        loop.close()


def test_a_live_gateways_requests_run_to_the_end(redis_server_url, redis_prefix):
    cfg = QueueConfig(prefix=redis_prefix, gateway_ttl_s=0.3, heartbeat_interval_s=0.05)
    gq, sq = make_queues(redis_server_url, config=cfg, gateway_id="gw", consumer="s")
    sched = Scheduler(sq, SimWorker(delay_s=0.01))

    async def main():
        stream = gq.events()  # reading events renews the lease
        await gq.submit(request("r", max_tokens=60))
        evs = []
        while not (evs and evs[-1].finish_reason):
            evs.append(await asyncio.wait_for(anext(stream), 5))
        await stream.aclose()
        await gq.close()
        return evs

    try:
        evs = asyncio.run(main())
        assert evs[-1].finish_reason == "length" and len(evs) == 60
    finally:
        sched.close()



def test_a_publish_racing_a_claim_sends_only_the_requests_still_owned(redis_server_url, redis_prefix):
    """The claim lands between the owner's last heartbeat and its publish: Redis refuses the
    claimed request's events in the same atomic step, the owner's other request goes out."""
    fast = QueueConfig(prefix=redis_prefix, claim_min_idle_ms=CLAIM_IDLE_MS, heartbeat_interval_s=0.05)
    slow = QueueConfig(prefix=redis_prefix, claim_min_idle_ms=CLAIM_IDLE_MS, heartbeat_interval_s=3600)
    gq = make_gateway_queue(redis_server_url, config=fast, gateway_id="gw")
    a = make_scheduler_queue(redis_server_url, config=slow, consumer="a")  # heartbeats once, at its first call
    b = make_scheduler_queue(redis_server_url, config=fast, consumer="b")
    r = redis.Redis.from_url(redis_server_url, decode_responses=True)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(gq.submit(request("lost", max_tokens=4)))
        assert [m.req_id for m in a.fetch(1)] == ["lost"]
        time.sleep(CLAIM_IDLE_MS / 1000 + 0.1)
        assert [m.req_id for m in b.replay_pending()] == ["lost"]
        loop.run_until_complete(gq.submit(request("kept", max_tokens=4)))
        assert [m.req_id for m in a.fetch(1)] == ["kept"]
        a.publish([TokenEvent("lost", 0, 1), TokenEvent("kept", 0, 2), TokenEvent("lost", 1, 3)])
        assert [(e["req_id"], e["token_id"], e["epoch"]) for e in _out_events(r, fast, "gw")] == [("kept", 2, 1)]
        assert a.take_lost() == ["lost"]
        a.publish([TokenEvent("lost", 2, 4)])  # known lost now: not even sent to Redis
        assert len(_out_events(r, fast, "gw")) == 1
    finally:
        a.close()
        b.close()
        loop.run_until_complete(gq.close())
        loop.close()


def test_the_former_owners_ack_leaves_the_request_with_its_new_owner(sides):
    gq, scheduler, loop = sides
    a, b = scheduler("a"), scheduler("b")
    loop.run_until_complete(gq.submit(request("r", max_tokens=4)))
    assert [m.req_id for m in a.fetch(1)] == ["r"]
    time.sleep(CLAIM_IDLE_MS / 1000 + 0.1)
    assert [m.req_id for m in b.replay_pending()] == ["r"]
    a.ack("r")  # "a" finished its run before it noticed the claim
    restarted_b = scheduler("b")  # b's pending entry is still there: a restart of b replays it
    assert [m.req_id for m in restarted_b.replay_pending()] == ["r"]
    restarted_b.ack("r")
    assert scheduler("b").replay_pending() == []
