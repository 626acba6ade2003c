"""Faults, end to end, on the deployments where each applies (real `sarathi` processes, the real
`openai` client, SmolLM2, a private redis-server per deployment so it can be restarted):

* a worker SIGKILLed mid-batch is noticed within 2 s (link heartbeat, not the 120 s reply
  timeout); its requests are replayed on the worker that comes back and end with exactly the
  offline engine's greedy text; if none comes back within worker_restart_timeout they end with
  an explicit error;
* Redis restarted (empty) under load: every accepted request completes or ends with an explicit
  error, none hangs, the Redis keys are clean afterwards;
* SIGTERM to the gateway: /ready and new requests answer 503 at once, started requests finish,
  then the process exits 0.
"""
from __future__ import annotations

import asyncio
import signal
import time
import uuid

import openai
import pytest
import redis

from shared.model_source import resolve_model
from shared.sampling import SamplingParams
from tests.support.e2e_stack import NUM_BLOCKS, DistributedStack, EmbeddedStack, get, metric
from tests.support.redis_fixture import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = resolve_model(None).name
PROMPTS = [f"Story {i}: the old lighthouse keeper" for i in range(6)]
TOKENS = 24
# distributed: the test restarts the worker itself (one starts in ~7 s), and waits this long when it does not
RESTART_TIMEOUT_S = 15
EMBEDDED_RESTART_TIMEOUT_S = 45  # `sarathi serve` respawns a worker: reloading SmolLM2 takes 5-35 s on 2 busy cores


@pytest.fixture(scope="module")
def offline():
    from sarathi.llm import LLM

    outs = LLM(num_blocks=256).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=TOKENS))
    return {p: o.text for p, o in zip(PROMPTS, outs)}


@pytest.fixture(scope="module", params=["embedded", "embedded-redis", "distributed-redis"])
def stack(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults-" + request.param)
    server = RedisServer() if request.param != "embedded" else None
    prefix = f"test:faults:{uuid.uuid4().hex[:8]}:"
    if request.param == "distributed-redis":
        s = DistributedStack(tmp, server.url, prefix, scheduler_options={"worker_restart_timeout": RESTART_TIMEOUT_S},
                             gateway_options={"drain_timeout": 60})
    else:
        s = EmbeddedStack(tmp, server.url if server else None, prefix,
                          worker_restart_timeout=EMBEDDED_RESTART_TIMEOUT_S, drain_timeout=60)
    s.mode, s.redis = request.param, server
    yield s
    s.close()
    if server is not None:
        server.stop()


async def _one(c: openai.AsyncOpenAI, prompt: str, started: list, max_tokens: int = TOKENS):
    """(text, finish reason or 'error: ...')."""
    text, reason = "", None
    try:
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            stream=True)
        async for ch in stream:
            if ch.choices:
                if not text and ch.choices[0].text:
                    started.append(prompt)
                text += ch.choices[0].text
                reason = ch.choices[0].finish_reason or reason
    except openai.APIError as e:  # an explicit error (status or an error event) is an acceptable end
        return text, f"error: {e}"
    return text, reason


def _under_load(stack, fault, prompts=PROMPTS, max_tokens: int = TOKENS, timeout: float = 240):
    """Run `prompts` as streams; once all streamed a token, run fault() in a thread; returns
    [(text, reason)] (none may hang: bounded by timeout) and fault()'s result."""
    async def run():
        started: list = []
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=timeout) as c:
            tasks = [asyncio.create_task(_one(c, p, started, max_tokens)) for p in prompts]
            deadline = time.monotonic() + 120
            while len(started) < len(prompts) and not all(t.done() for t in tasks):
                assert time.monotonic() < deadline, "the requests did not start"
                await asyncio.sleep(0.02)
            result = await asyncio.to_thread(fault)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout), result

    return asyncio.run(run())


def _wait_metric(url: str, name: str, value: float, timeout: float) -> float:
    """Seconds until metric `name` at `url` equals value (fails after timeout)."""
    t0 = time.monotonic()
    while metric(get(url)[1], name) != value:
        assert time.monotonic() - t0 < timeout, f"{name} did not become {value} within {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def _assert_kv_all_free(stack) -> None:
    deadline = time.monotonic() + 30
    while metric(get(stack.scheduler_metrics_url)[1], "sarathi_scheduler_kv_free_blocks") != NUM_BLOCKS:
        assert time.monotonic() < deadline, "KV blocks were not all freed"
        time.sleep(0.1)


def test_a_killed_worker_is_noticed_within_2s_and_its_requests_are_replayed(stack, offline):
    url = stack.scheduler_metrics_url

    def kill():
        stack.kill_worker()
        noticed = _wait_metric(url, "sarathi_scheduler_worker_up", 0, timeout=10)
        if isinstance(stack, DistributedStack):
            stack.start_worker()  # what compose / k8s would do
        return noticed

    results, noticed_s = _under_load(stack, kill)
    assert noticed_s < 2.0
    assert [r for _, r in results] == ["length"] * len(PROMPTS)
    assert [t for t, _ in results] == [offline[p] for p in PROMPTS]  # replayed: nothing lost or repeated
    text = get(url)[1]
    assert metric(text, "sarathi_scheduler_worker_up") == 1
    assert metric(text, "sarathi_scheduler_worker_lost_total") >= 1
    _assert_kv_all_free(stack)


def test_a_worker_that_does_not_come_back_fails_its_requests_explicitly(stack, offline):
    if not isinstance(stack, DistributedStack):
        pytest.skip("in embedded mode `sarathi serve` always starts a new worker")
    t0 = []

    def kill():
        # the clock starts as the kill begins: the scheduler can notice the loss before the
        # killed process has been reaped and kill_worker() returns
        t0.append(time.monotonic())
        stack.kill_worker()

    try:
        results, _ = _under_load(stack, kill)
        failed_after = time.monotonic() - t0[0]
        assert all(r.startswith("error") and "no worker answered" in r for _, r in results), results
        assert all(offline[p].startswith(t) for p, (t, _) in zip(PROMPTS, results))
        assert RESTART_TIMEOUT_S <= failed_after < RESTART_TIMEOUT_S + 10
        assert get(stack.scheduler_metrics_url.replace("/metrics", "/ready"))[0] == 503
    finally:          # the module's later tests share this stack: its worker comes back either way
        stack.start_worker()
        stack.wait()
    r = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=120).completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0)
    assert r.choices[0].text == offline[PROMPTS[0]]
    _assert_kv_all_free(stack)


def test_a_redis_restart_under_load_loses_nothing_and_hangs_nothing(stack, offline):
    if stack.redis is None:
        pytest.skip("the in-process queue has no Redis to restart")
    c = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=120)

    def restart():
        stack.redis.stop()
        try:  # while Redis is down a new request is refused explicitly, not queued into nowhere
            c.completions.create(model=MODEL, prompt="x", max_tokens=2)
            refused = None
        except openai.APIStatusError as e:
            refused = e.status_code
        time.sleep(1.0)
        stack.redis.start()  # an empty instance: the queued state is gone
        return refused

    results, refused = _under_load(stack, restart, max_tokens=40)
    assert refused == 503
    for prompt, (text, reason) in zip(PROMPTS, results):
        assert reason is not None, f"{prompt!r} ended without a finish reason"
        if not reason.startswith("error"):
            assert reason == "length" and len(text) > len(offline[prompt]) and text.startswith(offline[prompt])
    assert sum(r == "length" for _, r in results) == len(PROMPTS)  # all completed (resubmitted)
    stack.wait()  # both sides reconnected: /ready again
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0)
    assert r.choices[0].text == offline[PROMPTS[0]]
    _assert_kv_all_free(stack)
    rd = redis.Redis.from_url(stack.redis.url, decode_responses=True)
    deadline = time.monotonic() + 10
    while rd.xlen(stack.prefix + "requests") or rd.xpending(stack.prefix + "requests", "schedulers")["pending"]:
        assert time.monotonic() < deadline, "requests left in the stream or pending after they ended"
        time.sleep(0.2)


def test_sigterm_drains_then_exits(stack, offline):
    proc = stack.gateway_proc
    ready_url = stack.base_url.replace("/v1", "/ready")
    c = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=30)

    def term():
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while get(ready_url)[0] != 503:
            assert time.monotonic() < deadline, "/ready did not turn 503 on SIGTERM"
            time.sleep(0.02)
        try:
            c.completions.create(model=MODEL, prompt="x", max_tokens=2)
            return None
        except openai.APIStatusError as e:
            return e.status_code, e.code

    results, refused = _under_load(stack, term, prompts=PROMPTS[:4])
    assert refused == (503, "server_shutting_down")
    assert results == [(offline[p], "length") for p in PROMPTS[:4]]
    assert proc.wait(30) == 0
