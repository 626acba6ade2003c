"""Bad input cannot stall other users: while eight clients send ~4 MB chat bodies at once, a
running stream's largest gap between SSE events stays under 0.5 s and /health answers. Two kinds
of bodies: text over the size bound (refused while parsing) and text under it that must be
tokenized before the context check refuses it (tokenized on the bounded pool, without the GIL).
Real uvicorn, a fake scheduler pacing the victim's tokens 20 ms apart."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from shared import limits as L
from tests.support.gateway_fakes import Plan

MSG = [{"role": "user", "content": "Hi"}]
GAP_S = 0.02           # the victim's token interval
ATTACKERS = 8


@pytest.fixture(scope="module")
def server(tokenizer):
    from gateway.app import create_app
    from shared.config import ModelInfo
    from shared.queue import QueueConfig, make_queues
    from tests.support.gateway_fakes import FakeScheduler, ServerThread

    gq, sq = make_queues(None, config=QueueConfig(prefix="stall:"), consumer="fake-scheduler")
    # a context long enough that text under the size bound passes the cheap length check and
    # has to be tokenized before it is refused
    info = ModelInfo("smol-test", 1 << 16, tokenizer.vocab_size, tokenizer.eos_token_ids)
    fake = FakeScheduler(sq, tokenizer, plan=lambda req: Plan("one two three four " * 10, interval_s=GAP_S,
                                                                 hold=True))
    srv = ServerThread(create_app(tokenizer, info, gq))
    yield srv.url
    srv.stop()
    fake.close()


def stream_event_times(url: str, stop: threading.Event, times: list[float]) -> None:
    body = {"messages": MSG, "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                times.append(time.perf_counter())
            if stop.is_set():
                return


def attack(url: str, content: bytes, statuses: list[int]) -> None:
    r = httpx.post(url + "/v1/chat/completions", content=content, timeout=60,
                   headers={"Content-Type": "application/json"})
    statuses.append(r.status_code)


@pytest.mark.parametrize("chars", [3_900_000, L.MAX_TEXT_CHARS - 100], ids=["over-the-bound", "tokenized"])
def test_eight_big_bodies_do_not_stall_a_running_stream(server, chars):
    content = httpx.Request("POST", "/", json={"messages": [{"role": "user", "content": "hello " * (chars // 6)}],
                                               "max_tokens": 4}).content
    times: list[float] = []
    stop = threading.Event()
    victim = threading.Thread(target=stream_event_times, args=(server, stop, times))
    victim.start()
    deadline = time.monotonic() + 10
    while len(times) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(times) >= 10, "the victim's stream did not start"
    statuses: list[int] = []
    health: list[float] = []
    t_attack = time.perf_counter()
    attackers = [threading.Thread(target=attack, args=(server, content, statuses)) for _ in range(ATTACKERS)]
    for t in attackers:
        t.start()
    while any(t.is_alive() for t in attackers):
        t0 = time.perf_counter()
        assert httpx.get(server + "/health", timeout=10).status_code == 200
        health.append(time.perf_counter() - t0)
        time.sleep(0.05)
    for t in attackers:
        t.join()
    t_done = time.perf_counter()
    time.sleep(0.3)          # a stall would show as a gap after the attack too
    stop.set()
    victim.join(10)
    assert statuses == [400] * ATTACKERS
    window = [t for t in times if t >= t_attack - 0.5]
    gaps = [b - a for a, b in zip(window, window[1:])]
    assert window and window[-1] > t_done, "the stream stopped during the attack"
    assert max(gaps) < 0.5, f"largest gap {max(gaps):.3f} s over {len(gaps)} events (attack {t_done - t_attack:.2f} s)"
    assert max(health) < 0.5, f"/health took {max(health):.3f} s"
