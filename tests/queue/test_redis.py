"""What only the Redis implementation has: its key layout, trimming and bad entries."""
from __future__ import annotations

import asyncio
import json
import time

import redis

from shared.messages import RequestMsg, TokenEvent
from shared.queue import QueueConfig, make_gateway_queue, make_queues
from shared.sampling import SamplingParams


def _req(req_id: str, gw: str) -> RequestMsg:
    return RequestMsg(req_id, [1, 2], SamplingParams(), gw, time.time())


def test_a_malformed_entry_is_dropped_without_wedging_the_consumer(redis_server_url, redis_prefix):
    cfg = QueueConfig(prefix=redis_prefix)
    gq, sq = make_queues(redis_server_url, config=cfg, gateway_id="gw", consumer="s1")
    r = redis.Redis.from_url(redis_server_url, decode_responses=True)
    r.xadd(cfg.requests_key, {"req": "{not json"})
    asyncio.run(gq.submit(_req("ok", "gw")))
    assert [m.req_id for m in sq.fetch(10)] == ["ok"]
    assert r.xlen(cfg.requests_key) == 1  # the bad entry was acked and deleted
    sq.close()


def test_reply_streams_are_capped_and_expire(redis_server_url, redis_prefix):
    cfg = QueueConfig(prefix=redis_prefix, out_ttl_s=60)
    _, sq = make_queues(redis_server_url, config=cfg, gateway_id="gw", consumer="s1")
    sq.publish([TokenEvent("x", 0, 1)], reply_to={"x": "gw"})
    r = redis.Redis.from_url(redis_server_url, decode_responses=True)
    assert 0 < r.ttl(cfg.out_key("gw")) <= 60
    sq.close()


def test_the_gateway_trims_reply_entries_it_has_read(redis_server_url, redis_prefix):
    cfg = QueueConfig(prefix=redis_prefix)
    gq, sq = make_queues(redis_server_url, config=cfg, gateway_id="gw", consumer="s1")
    r = redis.Redis.from_url(redis_server_url, decode_responses=True)

    async def main():
        stream = gq.events()
        for i in range(300):
            sq.publish([TokenEvent("x", i, 1)], reply_to={"x": "gw"})
        seen = [await anext(stream) for _ in range(300)]
        await asyncio.sleep(1.1)
        sq.publish([TokenEvent("x", 300, 1)], reply_to={"x": "gw"})
        seen.append(await anext(stream))
        await stream.aclose()
        await gq.close()
        return seen

    assert [e.index for e in asyncio.run(main())] == list(range(301))
    assert r.xlen(cfg.out_key("gw")) < 300
    sq.close()


def test_the_scheduler_side_survives_its_stream_and_group_vanishing(redis_server_url, redis_prefix):
    """What an empty, restarted Redis looks like to a scheduler holding pending requests: the
    next heartbeat, poll and fetch re-create the group instead of raising (a pipeline's NOGROUP
    error included), and a request sent again is taken and acked under both entries."""
    cfg = QueueConfig(prefix=redis_prefix, heartbeat_interval_s=0.0)
    gq, sq = make_queues(redis_server_url, config=cfg, consumer="c1")
    asyncio.run(gq.submit(_req("a", gq.gateway_id)))
    assert [m.req_id for m in sq.fetch(4)] == ["a"]
    r = redis.Redis.from_url(redis_server_url)
    r.delete(cfg.requests_key)                  # stream and group gone, "a" still pending here
    sq.heartbeat()
    assert sq.poll_aborts() == []
    assert sq.fetch(4) == []
    gq2 = make_gateway_queue(redis_server_url, config=cfg, gateway_id=gq.gateway_id)  # a fresh loop
    asyncio.run(gq2.submit(_req("a", gq.gateway_id)))  # the gateway resubmits it
    assert [m.req_id for m in sq.fetch(4)] == ["a"]
    sq.ack("a")
    assert r.xlen(cfg.requests_key) == 0
    assert r.xpending(cfg.requests_key, cfg.group)["pending"] == 0
    sq.close()


def test_the_scheduler_side_loads_its_scripts_again_after_a_script_flush(redis_server_url, redis_prefix):
    """A Redis that restarted (or was told SCRIPT FLUSH) forgot the fence's scripts: the next
    heartbeat and publish load them again instead of failing."""
    cfg = QueueConfig(prefix=redis_prefix, heartbeat_interval_s=0.0)
    gq, sq = make_queues(redis_server_url, config=cfg, gateway_id="gw", consumer="c1")
    asyncio.run(gq.submit(_req("a", "gw")))
    assert [m.req_id for m in sq.fetch(4)] == ["a"]
    r = redis.Redis.from_url(redis_server_url, decode_responses=True)
    r.script_flush()
    sq.heartbeat()
    assert sq.take_lost() == []
    r.script_flush()
    sq.publish([TokenEvent("a", 0, 9, "length")])
    (entry,) = r.xrange(cfg.out_key("gw"))
    assert [(e["req_id"], e["epoch"]) for e in json.loads(entry[1]["events"])] == [("a", 1)]
    sq.ack("a")
    assert r.hget(cfg.epochs_key, "a") is None  # the epoch leaves with the request
    sq.close()
