"""The benchmarks' endpoint picker in front of replicas (bench/picker_router.py): fake replicas
that answer OpenAI requests with SSE, export vLLM's load metrics and publish real KV-cache events
(vLLM's msgpack batches over ZeroMQ PUB, with a replay socket); the router is real (uvicorn,
ZeroMQ SUB, the simulator's scorers)."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from bench.picker_router import Backend, Router, create_app, parse_load
from scheduler_svc.kv_events import BlockStored, ZmqEventPublisher, prefix_hashes
from tests.support.gateway_fakes import ServerThread

BS = 16


class FakeRecorder:
    """What ZmqEventPublisher drains: events queued by the test."""

    def __init__(self):
        self.pending, self.lock = [], threading.Lock()

    def store(self, token_ids: list[int]) -> None:
        hashes = prefix_hashes(token_ids, BS)
        with self.lock:
            self.pending.append(BlockStored(hashes, None, token_ids[:len(hashes) * BS], BS))

    def drain(self):
        with self.lock:
            out, self.pending = self.pending, []
        return out


class FakeReplica:
    """/metrics with a settable queue, /v1/completions streaming three SSE chunks (the body's
    prompt echoed in the first), KV events on loopback ZeroMQ."""

    def __init__(self, name: str):
        self.name, self.waiting, self.kv, self.bodies, self.auth = name, 0, 0.0, [], []
        self.recorder = FakeRecorder()
        self.pub = ZmqEventPublisher(self.recorder, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")

        async def metrics(request):
            return PlainTextResponse(
                f'# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name="m"}} '
                f'{float(self.waiting)}\nvllm:kv_cache_usage_perc{{model_name="m"}} {self.kv}\n')

        async def completions(request):
            body = await request.json()
            self.bodies.append(body)
            self.auth.append(request.headers.get("authorization"))

            async def sse():
                for k in range(3):
                    chunk = {"choices": [{"index": 0, "text": f"{self.name}{k}",
                                          "finish_reason": "length" if k == 2 else None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    await asyncio.sleep(0.05)
                yield b"data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")

        self.server = ServerThread(Starlette(routes=[Route("/metrics", metrics),
                                                     Route("/v1/completions", completions, methods=["POST"])]))
        self.backend = Backend(self.server.url, self.pub.endpoint, self.pub.replay_endpoint)

    def close(self) -> None:
        self.server.stop()
        self.pub.close()


@pytest.fixture
def replicas():
    reps = [FakeReplica("a"), FakeReplica("b")]
    yield reps
    for r in reps:
        r.close()


def start_router(reps, routing="mix", api_key=None, backend_api_key=None):
    router = Router([r.backend for r in reps], routing, block_size=BS, poll_s=0.02, backend_api_key=backend_api_key)
    return router, ServerThread(create_app(router, api_key))


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def complete(url: str, prompt, **headers) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 3,
                                                     "stream": True}, headers=headers, timeout=10)


def test_picks_the_replica_that_announced_the_prefix_and_passes_sse_through(replicas):
    prompt = list(range(100, 100 + 5 * BS + 3))
    # replica b announces the prompt's blocks before the router runs: it joins late, so it gets
    # them from b's replay socket
    replicas[1].recorder.store(prompt)
    wait_for(lambda: replicas[1].pub.next_seq == 1)
    router, server = start_router(replicas)
    try:
        wait_for(lambda: router.events.batches[1] == 1)
        assert router.events.replays >= 1
        for _ in range(5):          # every time, not by the tie-break's luck
            r = complete(server.url, prompt + [7, 8])
            assert r.status_code == 200 and r.headers["x-routed-to"] == "1"
            assert r.headers["content-type"].startswith("text/event-stream")
            chunks = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert [c["choices"][0]["text"] for c in chunks] == ["b0", "b1", "b2"]
            assert r.text.rstrip().endswith("data: [DONE]")
        assert replicas[1].bodies[-1]["prompt"] == prompt + [7, 8]    # the body unchanged
        assert replicas[0].bodies == []
        # a live event moves the next conversation to replica a
        other = list(range(5000, 5000 + 4 * BS))
        replicas[0].recorder.store(other)
        wait_for(lambda: router.events.batches[0] == 1)
        assert complete(server.url, other).headers["x-routed-to"] == "0"
        assert router.scorer.matched_blocks == 5 * 5 + 4
    finally:
        server.stop()


def test_falls_back_on_load_without_a_cached_prefix(replicas):
    replicas[0].waiting, replicas[1].waiting = 6, 0
    router, server = start_router(replicas)
    try:
        wait_for(lambda: router.waiting == [6.0, 0.0])
        fresh = list(range(300, 300 + 3 * BS))
        assert {complete(server.url, fresh).headers["x-routed-to"] for _ in range(4)} == {"1"}
        replicas[0].waiting, replicas[1].waiting = 0, 6
        wait_for(lambda: router.waiting == [0.0, 6.0])
        assert complete(server.url, list(range(900, 900 + 3 * BS))).headers["x-routed-to"] == "0"
    finally:
        server.stop()


def test_a_stranger_is_refused_and_an_open_bind_needs_a_key(replicas):
    _, server = start_router(replicas, api_key="sekret", backend_api_key="inner")
    try:
        assert complete(server.url, [1, 2, 3]).status_code == 401
        assert complete(server.url, [1, 2, 3], Authorization="Bearer wrong").status_code == 401
        assert httpx.get(server.url + "/stats").status_code == 401
        ok = complete(server.url, [1, 2, 3], Authorization="Bearer sekret")
        assert ok.status_code == 200 and "data: [DONE]" in ok.text
        # the replica gets the router's own key for it, never the client's
        assert [a for r in replicas for a in r.auth] == ["Bearer inner"]
    finally:
        server.stop()
    from bench.picker_router import main
    from gateway.server import UnauthenticatedBindError

    with pytest.raises(UnauthenticatedBindError):
        main(["--host", "0.0.0.0", "--replica", replicas[0].server.url])


def test_parse_load_reads_the_vllm_gauges():
    text = ('# HELP vllm:num_requests_waiting x\nvllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{model_name="m"} 2.0\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\n')
    assert parse_load(text) == (3.0, 0.25)


def test_kv_cost_and_cache_aware_route_on_the_routers_own_bookkeeping(replicas):
    """kv-cost (Dynamo) and cache-aware (SGLang) keep their own count of what they sent: a
    request is in flight until its answer ends, its uncached prompt tokens pending until the
    answer's first bytes, its prompt's blocks held until the end; both follow a replica that
    announced the prompt's blocks."""
    prompt = list(range(100, 100 + 5 * BS + 3))
    replicas[1].recorder.store(prompt)
    wait_for(lambda: replicas[1].pub.next_seq == 1)
    for routing in ("kv-cost", "cache-aware"):
        router, server = start_router(replicas, routing)
        try:
            wait_for(lambda: router.events.batches[1] == 1)
            with httpx.stream("POST", server.url + "/v1/completions", timeout=10,
                              json={"model": "m", "prompt": prompt, "max_tokens": 3, "stream": True}) as r:
                assert r.headers["x-routed-to"] == "1"
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")        # the first bytes are back
                assert router.in_flight == [0, 1]
                assert router.prefill == [0, 0]                 # released at the first bytes
                assert router.active_blocks == [0, 6]           # 83 tokens: 6 blocks of 16
                assert sum(1 for _ in lines) > 0
            wait_for(lambda: router.in_flight == [0, 0])
            assert router.active_blocks == [0, 0] and router.prefill == [0, 0]
            assert router.scorer.matched_blocks == 5
            # nothing cached anywhere: cache-aware takes the replica caching the fewest blocks (a),
            # kv-cost the one with the least work (a tie: either)
            got = complete(server.url, list(range(7000, 7000 + 3 * BS))).headers["x-routed-to"]
            assert got == "0" if routing == "cache-aware" else got in ("0", "1")
        finally:
            server.stop()
