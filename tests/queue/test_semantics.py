"""The queue's contract, checked on both implementations: in-process and real Redis."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from shared.messages import RequestMsg, TokenEvent
from shared.queue import QueueConfig, make_gateway_queue, make_scheduler_queue
from shared.queue.local import LocalBroker
from shared.sampling import SamplingParams


class Harness:
    """Makes gateway and scheduler sides over one backend; runs the async side on one loop."""

    def __init__(self, kind: str, redis_url: str | None, prefix: str):
        self.cfg = QueueConfig(prefix=prefix, claim_min_idle_ms=300, heartbeat_interval_s=0.05)
        self.url = redis_url if kind == "redis" else None
        self.broker = None if self.url else LocalBroker(self.cfg)
        self.loop = asyncio.new_event_loop()
        self.gateways, self.schedulers = [], []

    def gateway(self, gateway_id: str = "gw-a"):
        gq = make_gateway_queue(self.url, config=self.cfg, gateway_id=gateway_id, broker=self.broker)
        gq.stream = gq.events()
        self.gateways.append(gq)
        return gq

    def scheduler(self, consumer: str = "s1"):
        sq = make_scheduler_queue(self.url, config=self.cfg, consumer=consumer, broker=self.broker)
        self.schedulers.append(sq)
        return sq

    def run(self, coro, timeout: float = 5.0):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def next_events(self, gq, n: int, timeout: float = 5.0) -> list[TokenEvent]:
        async def take():
            return [await anext(gq.stream) for _ in range(n)]
        return self.run(take(), timeout)

    def close(self):
        for gq in self.gateways:
            self.run(gq.stream.aclose())
            self.run(gq.close())
        for sq in self.schedulers:
            sq.close()
        self.loop.close()


@pytest.fixture(params=["local", "redis"])
def h(request):
    if request.param == "redis":
        url, prefix = request.getfixturevalue("redis_server_url"), request.getfixturevalue("redis_prefix")
    else:
        url, prefix = None, "local:"
    harness = Harness(request.param, url, prefix)
    yield harness
    harness.close()


def req(req_id: str, reply_to: str = "gw-a", n_prompt: int = 3) -> RequestMsg:
    return RequestMsg(req_id, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=4), reply_to, time.time())


def ids(reqs) -> list[str]:
    return [r.req_id for r in reqs]


def test_submitted_request_waits_until_a_scheduler_fetches_it(h):
    gq = h.gateway()
    h.run(gq.submit(req("r1")))  # no scheduler exists yet: the request must still be kept
    sq = h.scheduler()
    got = sq.fetch(8)
    assert ids(got) == ["r1"]
    assert got[0].prompt_token_ids == [1, 2, 3] and got[0].sampling.max_tokens == 4


def test_fetch_takes_at_most_max_n_in_arrival_order_and_depth_counts_the_rest(h):
    gq, sq = h.gateway(), h.scheduler()
    for i in range(5):
        h.run(gq.submit(req(f"r{i}")))
    assert h.run(gq.depth()) == 5
    assert sq.fetch(0) == []
    assert ids(sq.fetch(2)) == ["r0", "r1"]
    assert h.run(gq.depth()) == 3
    assert ids(sq.fetch(10)) == ["r2", "r3", "r4"]
    assert h.run(gq.depth()) == 0
    assert sq.fetch(10) == []


def test_fetch_blocks_up_to_block_ms_for_a_new_request(h):
    gq, sq = h.gateway(), h.scheduler()
    t0 = time.monotonic()
    assert sq.fetch(4, block_ms=150) == []
    assert time.monotonic() - t0 >= 0.1
    result = []
    t = threading.Thread(target=lambda: result.extend(sq.fetch(4, block_ms=3000)))
    t.start()
    time.sleep(0.1)
    h.run(gq.submit(req("late")))
    t.join(5)
    assert ids(result) == ["late"]


def test_each_request_goes_to_exactly_one_of_several_schedulers(h):
    gq, s1, s2 = h.gateway(), h.scheduler("s1"), h.scheduler("s2")
    for i in range(6):
        h.run(gq.submit(req(f"r{i}")))
    got = ids(s1.fetch(3)) + ids(s2.fetch(10))
    assert sorted(got) == [f"r{i}" for i in range(6)]


def test_unacked_requests_are_replayed_after_a_restart_and_acked_ones_are_not(h):
    gq, sq = h.gateway(), h.scheduler("s1")
    for i in range(3):
        h.run(gq.submit(req(f"r{i}")))
    assert len(sq.fetch(3)) == 3
    sq.ack("r1")
    sq.ack("never-seen")  # unknown ids are a no-op
    restarted = h.scheduler("s1")  # same consumer name: a restarted replica
    assert sorted(ids(restarted.replay_pending())) == ["r0", "r2"]
    assert restarted.fetch(10) == []  # replayed requests are not "new"


def test_a_dead_consumers_requests_are_claimed_once_idle(h):
    gq, dead = h.gateway(), h.scheduler("dead")
    h.run(gq.submit(req("r0")))
    assert ids(dead.fetch(1)) == ["r0"]
    other = h.scheduler("other")
    assert other.replay_pending() == []  # not idle long enough yet
    time.sleep(0.4)
    assert ids(other.replay_pending()) == ["r0"]
    other.ack("r0")
    assert h.scheduler("dead").replay_pending() == []


def test_a_live_consumers_requests_are_not_claimed(h):
    gq, live = h.gateway(), h.scheduler("live")
    h.run(gq.submit(req("r0")))
    live.fetch(1)
    other = h.scheduler("other")
    for _ in range(8):  # 0.4 s in all, heartbeating meanwhile
        time.sleep(0.05)
        live.poll_aborts()
    assert other.replay_pending() == []


def test_events_reach_only_the_gateway_named_in_reply_to(h):
    ga, gb, sq = h.gateway("gw-a"), h.gateway("gw-b"), h.scheduler()
    h.run(ga.submit(req("a1", "gw-a")))
    h.run(gb.submit(req("b1", "gw-b")))
    sq.fetch(2)
    sq.publish([TokenEvent("a1", 0, 11), TokenEvent("b1", 0, 21), TokenEvent("a1", 1, 12, "length")])
    got_a = h.next_events(ga, 2)
    assert [(e.req_id, e.index, e.token_id, e.finish_reason) for e in got_a] == [
        ("a1", 0, 11, None), ("a1", 1, 12, "length")]
    assert [(e.req_id, e.token_id) for e in h.next_events(gb, 1)] == [("b1", 21)]


def test_publish_uses_an_explicit_reply_to_for_requests_it_did_not_deliver(h):
    gq, sq = h.gateway("gw-a"), h.scheduler()
    sq.publish([TokenEvent("x", 0, None, "error", error="boom")], reply_to={"x": "gw-a"})
    (ev,) = h.next_events(gq, 1)
    assert (ev.req_id, ev.finish_reason, ev.error) == ("x", "error", "boom")


def test_the_first_event_carries_the_time_the_request_was_taken(h):
    gq, sq = h.gateway(), h.scheduler()
    h.run(gq.submit(req("r0")))
    t0 = time.time()
    sq.fetch(1)
    sq.publish([TokenEvent("r0", 0, 5), TokenEvent("r0", 1, 6)])
    first, second = h.next_events(gq, 2)
    assert t0 - 1 <= first.scheduled_time <= time.time() and second.scheduled_time is None


def test_aborts_reach_every_scheduler_once(h):
    gq, s1, s2 = h.gateway(), h.scheduler("s1"), h.scheduler("s2")
    h.run(gq.submit(req("r0")))
    s1.fetch(1)
    h.run(gq.abort("r0"))
    assert s1.poll_aborts() == ["r0"] and s2.poll_aborts() == ["r0"]
    assert s1.poll_aborts() == []


def test_a_request_aborted_while_queued_is_never_started(h):
    gq, sq = h.gateway(), h.scheduler()
    h.run(gq.submit(req("r0")))
    h.run(gq.submit(req("r1")))
    h.run(gq.abort("r0"))
    assert ids(sq.fetch(10)) == ["r1"]
    assert h.run(gq.depth()) == 0
    assert ids(h.scheduler("s1").replay_pending()) == ["r1"]  # r0 is not pending anywhere


def test_a_request_aborted_while_its_scheduler_was_down_is_not_replayed(h):
    gq, sq = h.gateway(), h.scheduler("s1")
    h.run(gq.submit(req("r0")))
    h.run(gq.submit(req("r1")))
    sq.fetch(2)
    sq.close()  # crashed
    h.run(gq.abort("r0"))
    assert ids(h.scheduler("s1").replay_pending()) == ["r1"]


def test_scheduler_alive_follows_the_heartbeat(h):
    gq = h.gateway()
    assert h.run(gq.scheduler_alive()) is False
    sq = h.scheduler()
    assert h.run(gq.scheduler_alive()) is False  # constructed is not yet running
    sq.poll_aborts()
    assert h.run(gq.scheduler_alive()) is True
    sq.close()
    assert h.run(gq.scheduler_alive()) is False
