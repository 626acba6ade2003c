"""Test doubles for the gateway tests: a scripted scheduler on a SchedulerQueue, a real uvicorn
server in a thread, and the fixtures that put them together (import `tokenizer` and
`make_stack` into a test module). The gateway is tested alone; the whole stack has its own
end-to-end tests."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx
import openai
import pytest
import uvicorn

from gateway.app import create_app
from sarathi.measure.scrape import summed
from shared.config import ModelInfo
from shared.messages import RequestMsg, TokenEvent
from shared.model_source import resolve_model
from shared.queue import QueueConfig, make_gateway_queue, make_queues
from shared.sampling import SamplingParams
from shared.tokenizer import load_tokenizer
from tests.support.redis_fixture import delete_prefix, free_port, new_prefix


@dataclass
class Plan:
    """How the fake scheduler answers one request.

    text: the reply, encoded with the real tokenizer; an EOS token (or the request's first stop
        token id) follows it (finish "stop") unless max_tokens cuts it first (finish "length").
    interval_s: seconds between tokens. error_after: after that many tokens, an error event.
    duplicate: publish every event twice, and replay the first tokens again midway (as a
        restarted scheduler would). hold: never finish (for disconnect tests).
    """

    text: str = "Hello world!"
    interval_s: float = 0.0
    error_after: int | None = None
    duplicate: bool = False
    hold: bool = False


@dataclass
class _Job:
    req: RequestMsg
    events: list[TokenEvent]
    interval_s: float
    next_at: float = 0.0
    pos: int = 0


@dataclass
class FakeScheduler:
    """Plays the scheduler: fetches requests from the queue only while `admitting`, emits the
    planned events, records aborts (and stops the aborted request), acks what ends."""

    queue: object
    tokenizer: object
    plan: Callable[[RequestMsg], Plan] = lambda req: Plan()
    admitting: bool = True
    received: list[RequestMsg] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self):
        self._jobs: dict[str, _Job] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-scheduler", daemon=True)
        self._thread.start()

    def events_for(self, req: RequestMsg, plan: Plan) -> list[TokenEvent]:
        end = (req.sampling.stop_token_ids or self.tokenizer.eos_token_ids)[0]  # as a model would
        ids = self.tokenizer.encode(plan.text, add_special_tokens=False) + [end]
        max_tokens = req.sampling.max_tokens
        if plan.hold:
            ids = ids * 1000
        events = [TokenEvent(req.req_id, i, t) for i, t in enumerate(ids[:max_tokens])]
        if req.sampling.logprobs is not None:  # made-up numbers: the gateway only formats them
            for e in events:
                e.logprob = -0.25 * (e.index + 1)
                k = req.sampling.logprobs
                e.top_logprobs = ([[e.token_id, e.logprob]] + [[100 + j, e.logprob - j - 1] for j in range(k)])[:k]
        if plan.error_after is not None:
            events = events[:plan.error_after] + [TokenEvent(req.req_id, plan.error_after, None, "error",
                                                             error="worker exploded")]
        elif not plan.hold:
            events[-1].finish_reason = "length" if len(ids) > max_tokens else "stop"
        if plan.duplicate:
            twice = [e for e in events for _ in range(2)]
            mid = len(twice) // 2
            events = twice[:mid] + events[:len(events) // 2] + twice[mid:]
        return events

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.admitting:
                for req in self.queue.fetch(16, block_ms=10 if not self._jobs else 0):
                    self.received.append(req)
                    plan = self.plan(req)
                    self._jobs[req.req_id] = _Job(req, self.events_for(req, plan), plan.interval_s)
            else:
                time.sleep(0.01)
            for req_id in self.queue.poll_aborts():
                self.aborted.append(req_id)
                if self._jobs.pop(req_id, None):
                    self.queue.ack(req_id)
            self._step()

    def _step(self) -> None:
        now, out = time.monotonic(), []
        for req_id, job in list(self._jobs.items()):
            if now < job.next_at:
                continue
            ev = job.events[job.pos]
            out.append(ev)
            job.pos, job.next_at = job.pos + 1, now + job.interval_s
            if job.pos == len(job.events):
                del self._jobs[req_id]
        if out:
            self.queue.publish(out)
            for ev in out:
                if ev.finish_reason is not None:
                    self.queue.ack(ev.req_id)
        else:
            time.sleep(0.002)

    def wait_aborted(self, req_id: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if req_id in self.aborted:
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.queue.close()


class ServerThread:
    """A real uvicorn server on a free port, in a thread with its own event loop."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)


# ---------------------------------------------------------------------------------------------
# fixtures (import them into a test module to use them)
# ---------------------------------------------------------------------------------------------
MAX_MODEL_LEN = 256  # tokens: small, so context-length errors are cheap to provoke


@dataclass
class Stack:
    """A gateway on a real uvicorn server, a fake scheduler, and the queue between them."""

    url: str
    fake: FakeScheduler
    server: ServerThread
    redis_url: str | None
    queue_config: QueueConfig
    broker: object

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=20)

    def prefill(self, n: int) -> None:
        """Queue n requests from another gateway, as if other clients were waiting."""
        async def submit():
            gq = make_gateway_queue(self.redis_url, config=self.queue_config, gateway_id="gw-other",
                                    broker=self.broker)
            for i in range(n):
                await gq.submit(RequestMsg(f"filler-{i}", [1], SamplingParams(), "gw-other", time.time()))
            await gq.close()
        asyncio.run(submit())

    def close(self) -> None:
        self.server.stop()
        self.fake.close()


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """Loaded once per process (seconds: it parses the GGUF), whichever module asks first."""
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="session")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture
def make_stack(request, tokenizer):
    stacks: list[Stack] = []
    prefixes: list[tuple[str, str]] = []  # Redis keys to delete once the stacks are stopped

    def make(backend: str = "local", plan: Callable[[RequestMsg], Plan] | None = None, admitting: bool = True,
             chat_template: str | None = None, **app_kwargs) -> Stack:
        """admitting=False: the fake scheduler takes nothing until told (set fake.admitting).
        chat_template: the gateway's tokenizer gets this template instead of SmolLM2's."""
        tok = tokenizer if chat_template is None else dataclasses.replace(tokenizer, chat_template=chat_template)
        url, prefix = None, "local:"
        if backend == "redis":
            url, prefix = request.getfixturevalue("redis_server_url"), new_prefix()
            prefixes.append((url, prefix))
        cfg = QueueConfig(prefix=prefix)
        gq, sq = make_queues(url, config=cfg, consumer="fake-scheduler")
        info = ModelInfo("smol-test", MAX_MODEL_LEN, tok.vocab_size, tok.eos_token_ids)
        fake = FakeScheduler(sq, tok, plan=plan or (lambda req: Plan()), admitting=admitting)
        stack = Stack("", fake, ServerThread(create_app(tok, info, gq, **app_kwargs)), url, cfg,
                      getattr(gq, "broker", None))
        stack.url = stack.server.url
        stacks.append(stack)
        return stack

    yield make
    for s in stacks:
        s.close()
    for url, prefix in prefixes:
        delete_prefix(url, prefix)


def metric(base_url: str, name: str) -> float:
    """The value of one unlabelled sample (or the sum over labels) on the gateway's /metrics."""
    return summed(httpx.get(base_url + "/metrics").text).get(name, 0.0)
