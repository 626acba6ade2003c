"""Neither a slow reader nor a burst of requests can make the gateway buffer or wait without
bound: a stream whose client stops reading is dropped after the send timeout and its request
aborted on the scheduler (real uvicorn, a raw socket that never reads); the preprocessing pool
refuses work beyond its bound at once and answers a job past its deadline with a 503."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from gateway.errors import APIError
from gateway.preprocess import PreprocessConfig, Preprocessor
from tests.support.gateway_fakes import Plan, metric


@pytest.fixture
def stack(tokenizer):
    """A gateway with a long context (a stream long enough to fill any socket buffer) and a
    0.5 s send timeout; the fake scheduler streams as fast as it can, without end for a request
    of more than 100 tokens."""
    from gateway.app import create_app
    from shared.config import ModelInfo
    from shared.queue import QueueConfig, make_queues
    from tests.support.gateway_fakes import FakeScheduler, ServerThread

    gq, sq = make_queues(None, config=QueueConfig(prefix="slow:"), consumer="fake-scheduler")
    info = ModelInfo("smol-test", 1 << 16, tokenizer.vocab_size, tokenizer.eos_token_ids)
    fake = FakeScheduler(sq, tokenizer, plan=lambda req: Plan("#" * 80 * 50, hold=req.sampling.max_tokens > 100))
    server = ServerThread(create_app(tokenizer, info, gq, sse_send_timeout_s=0.5))
    yield server, fake
    server.stop()
    fake.close()


def test_a_client_that_stops_reading_is_dropped_and_its_request_aborted(stack):
    server, fake = stack
    # 80 characters and 20 alternatives per token: kilobytes per event
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 60_000, "stream": True,
                       "logprobs": True, "top_logprobs": 20})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # a small window: the server blocks soon
    sock.connect(("127.0.0.1", server.port))
    try:
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        deadline = time.monotonic() + 10
        while not fake.received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fake.received, "the request did not reach the scheduler"
        # never read: the stream fills the socket, a send waits 0.5 s, the gateway gives up
        assert fake.wait_aborted(fake.received[-1].req_id, timeout=15), "the stalled stream was not dropped"
    finally:
        sock.close()
    # the server still serves others, and counts the drop
    r = httpx.post(server.url + "/v1/chat/completions", timeout=20,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert r.status_code == 200
    assert metric(server.url, "sarathi_gateway_streams_dropped_total") == 1


def run(coro):
    return asyncio.run(coro)


def test_the_pool_refuses_work_beyond_its_bound_at_once():
    release = threading.Event()
    pre = Preprocessor(PreprocessConfig(workers=1, max_pending=2, deadline_s=5))

    async def main():
        jobs = [asyncio.ensure_future(pre.run("job", release.wait)) for _ in range(2)]
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        with pytest.raises(APIError) as e:
            await pre.run("job", release.wait)
        assert time.perf_counter() - t0 < 0.05
        assert e.value.status == 503 and e.value.code == "server_busy" and "Retry-After" in e.value.headers
        release.set()
        assert await asyncio.gather(*jobs) == [True, True]
        await asyncio.sleep(0.05)
        assert pre.pending == 0
        assert await pre.run("job", lambda: 7) == 7

    try:
        run(main())
    finally:
        pre.close()


def test_a_job_past_its_deadline_is_a_503_and_keeps_its_slot_until_it_ends():
    release = threading.Event()
    pre = Preprocessor(PreprocessConfig(workers=1, max_pending=1, deadline_s=0.1))

    async def main():
        t0 = time.perf_counter()
        with pytest.raises(APIError) as e:
            await pre.run("compiling guided_grammar", release.wait)
        assert 0.1 <= time.perf_counter() - t0 < 0.5
        assert e.value.status == 503 and e.value.code == "preprocessing_timeout"
        assert "compiling guided_grammar" in e.value.message
        assert pre.pending == 1              # the thread still works on it: the bound counts it
        with pytest.raises(APIError):
            await pre.run("job", lambda: 1)
        release.set()
        await asyncio.sleep(0.05)
        assert pre.pending == 0

    try:
        run(main())
    finally:
        pre.close()
