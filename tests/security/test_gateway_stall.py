"""Bad input cannot stall other users: while eight clients send big chat bodies at once, a
running stream's largest gap between SSE events stays under 0.5 s and /health answers within
0.5 s. Two kinds of bodies: 3.9 MB of text, over the size bound (refused while parsing), and
300k characters under it, which must be tokenized before the context check refuses them
(tokenized on the bounded pool, without the GIL). The gateway runs in a process of its own
(real uvicorn, a fake scheduler pacing the victim's tokens 20 ms apart), so the clients' own
work here does not compete with it."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest

MSG = [{"role": "user", "content": "Hi"}]
ATTACKERS = 8
MAX_MODEL_LEN = 4096   # x 81 characters (SmolLM2's longest token) > 300k: such text is tokenized
SERVER = f"""
import sys
from gateway.app import create_app
from shared.config import ModelInfo
from shared.queue import QueueConfig, make_queues
from tests.support.gateway_fakes import FakeScheduler, Plan, ServerThread, smollm2_tokenizer
tok = smollm2_tokenizer()
gq, sq = make_queues(None, config=QueueConfig(prefix="stall:"), consumer="fake-scheduler")
info = ModelInfo("smol-test", {MAX_MODEL_LEN}, tok.vocab_size, tok.eos_token_ids)
fake = FakeScheduler(sq, tok, plan=lambda req: Plan("one two three four " * 10, interval_s=0.02, hold=True))
srv = ServerThread(create_app(tok, info, gq))
print(srv.url, flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), "the gateway process did not start"
        yield url
    finally:
        proc.stdin.close()
        proc.terminate()
        proc.wait(10)


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


@pytest.mark.parametrize("chars", [3_900_000, 300_000], ids=["over-the-bound", "tokenized"])
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
    attackers = [threading.Thread(target=attack, args=(server, content, statuses)) for _ in range(ATTACKERS)]
    t_attack = time.perf_counter()
    for t in attackers:
        t.start()
    with httpx.Client(base_url=server, timeout=10) as probe:   # connected before: times the server
        probe.get("/health")
        while any(t.is_alive() for t in attackers):
            t0 = time.perf_counter()
            assert probe.get("/health").status_code == 200
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
