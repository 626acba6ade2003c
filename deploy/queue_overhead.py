"""The queue's CPU cost per operation against a running Redis: this process's CPU time and the
Redis server's (INFO cpu), for a gateway's submit, a scheduler's publish of one iteration's
events (32 requests) and its heartbeat (32 requests held). CPU time, not wall time: on a shared
machine contention moves wall times by 2x, CPU times by a few percent. To compare two versions,
run it from each checkout against the same Redis.

    python deploy/queue_overhead.py [--redis-url redis://127.0.0.1:6379/0] [-n 1000]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not an installed one
from shared.messages import RequestMsg, TokenEvent  # noqa: E402
from shared.queue import QueueConfig, make_queues  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

BATCH = 32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("-n", type=int, default=1000, help="operations of each kind")
    a = ap.parse_args()
    prefix = f"overhead:{uuid.uuid4().hex[:8]}:"
    gq, sq = make_queues(a.redis_url, config=QueueConfig(prefix=prefix), gateway_id="gw", consumer="s1")
    r = redis.Redis.from_url(a.redis_url)

    def server_cpu() -> float:
        info = r.info("cpu")
        return info["used_cpu_sys"] + info["used_cpu_user"]

    def measure(name: str, out: dict, t0: tuple[float, float], n: int) -> None:
        out[name] = {"client_us": round((time.process_time() - t0[0]) / n * 1e6, 1),
                     "redis_us": round((server_cpu() - t0[1]) / n * 1e6, 1)}

    async def run() -> dict:
        out: dict = {}
        reqs = [RequestMsg(f"r{i}", list(range(64)), SamplingParams(max_tokens=16), "gw", time.time())
                for i in range(a.n)]
        t0 = (time.process_time(), server_cpu())
        for q in reqs:
            await gq.submit(q)
        measure("submit", out, t0, a.n)
        got: list = []
        while len(got) < BATCH:
            got += await asyncio.to_thread(sq.fetch, BATCH - len(got))
        ids = [m.req_id for m in got]
        t0 = (time.process_time(), server_cpu())
        for k in range(a.n):
            sq.publish([TokenEvent(x, k, 7) for x in ids])
        measure(f"publish_{BATCH}_events", out, t0, a.n)
        t0 = (time.process_time(), server_cpu())
        for _ in range(a.n):
            sq.heartbeat()
        measure(f"heartbeat_{BATCH}_held", out, t0, a.n)
        await gq.close()
        return out

    try:
        out = asyncio.run(run())
    finally:
        sq.close()
        keys = list(r.scan_iter(match=prefix + "*"))
        if keys:
            r.delete(*keys)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
