"""One request's life in the gateway, from submit to its last text delta.

`Dispatcher` is the single reader of the gateway's event stream: it routes each TokenEvent to
the asyncio.Queue of its request. `Generation` turns one request's events into text deltas:
it drops duplicate events (by index), detokenizes incrementally, applies stop strings, records
the latency metrics, and sends an abort when it ends before the scheduler's end (a stop string
or a client that went away).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from gateway.metrics import GatewayMetrics
from gateway.responses import TokenLogprob
from shared.messages import RequestMsg, TokenEvent
from shared.queue import GatewayQueue, QueueResetError

log = logging.getLogger(__name__)
INTERNAL_ERROR = "internal error"   # the scheduler's prefix for errors that carry exception text


class Dispatcher:
    """Routes queue.events() to per-request queues. Events of unknown (finished, aborted or
    never seen) requests are dropped."""

    def __init__(self, queue: GatewayQueue):
        self.queue = queue
        self._routes: dict[str, asyncio.Queue[TokenEvent]] = {}
        self.running = False
        self.on_queue_reset = None  # async () -> int: called when the queue lost its contents
        self._reset_tasks: set[asyncio.Task] = set()

    def open(self, req_id: str) -> asyncio.Queue[TokenEvent]:
        q = self._routes[req_id] = asyncio.Queue()
        return q

    def close(self, req_id: str) -> None:
        self._routes.pop(req_id, None)

    async def run(self) -> None:
        """Until cancelled; a failing event stream (e.g. Redis restarting) is retried."""
        while True:
            try:
                self.running = True
                async for ev in self.queue.events():
                    q = self._routes.get(ev.req_id)
                    if q is not None:
                        q.put_nowait(ev)
            except asyncio.CancelledError:
                raise
            except QueueResetError as e:  # e.g. Redis restarted empty: queued requests are gone
                log.warning("%s; resubmitting the unfinished requests", e)
                if self.on_queue_reset is not None:
                    task = asyncio.ensure_future(self.on_queue_reset())
                    self._reset_tasks.add(task)
                    task.add_done_callback(self._reset_tasks.discard)
            except Exception:  # noqa: BLE001 - keep serving; the stream resumes where it was
                self.running = False
                log.exception("event stream failed; retrying")
                await asyncio.sleep(0.5)


@dataclass
class Delta:
    """New text of a request. finish_reason is set on the last delta only; error with it when
    finish_reason == "error". num_tokens: completion tokens so far. logprobs: the tokens whose
    text this delta releases (when the request asked for logprobs; an ending EOS is left out,
    as its text is)."""

    text: str
    num_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None


class Generation:
    """Events -> deltas for one request. Use: `await start()`, iterate `deltas()`, and always
    `await close()` (it aborts the request if it did not finish)."""

    def __init__(self, req: RequestMsg, *, tokenizer, queue: GatewayQueue, dispatcher: Dispatcher,
                 metrics: GatewayMetrics, stop: list[str], end_token_ids: set[int],
                 event_timeout_s: float | None):
        self.req, self.queue, self.dispatcher, self.metrics = req, queue, dispatcher, metrics
        self._detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids)
        self._stops = StopStringMatcher(stop)
        self._end_ids = end_token_ids  # a "stop" ending on one of these does not show its text
        self._timeout = event_timeout_s
        self._events = dispatcher.open(req.req_id)
        self._next_index = 0
        self._last_token_time: float | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_tokens = 0
        self._started = self._closed = False
        self._scheduler_done = False  # the scheduler sent this request's end: no abort needed
        self._logprobs: list[TokenLogprob] | None = [] if req.sampling.logprobs is not None else None

    async def start(self) -> None:
        """Queue the request (durable on return)."""
        try:
            await self.queue.submit(self.req)
        except BaseException:
            self.dispatcher.close(self.req.req_id)
            raise
        self._started = True
        self.metrics.accepted.inc()
        self.metrics.in_flight.inc()
        self.metrics.prompt_tokens.inc(len(self.req.prompt_token_ids))

    async def deltas(self) -> AsyncIterator[Delta]:
        while self.finish_reason is None:
            try:
                ev = await asyncio.wait_for(self._events.get(), self._timeout)
            except TimeoutError:  # a lost scheduler must not leave the client hanging forever
                yield self._finish("error", "", f"no token for {self._timeout:.0f} s")
                return
            if ev is None:  # closed meanwhile (the client left): nobody reads on
                return
            delta = self._on_event(ev)
            if delta is not None:
                yield delta

    def _on_event(self, ev: TokenEvent) -> Delta | None:
        delta = self._text_delta(ev)
        if delta is not None and self._logprobs is not None:
            delta.logprobs, self._logprobs = self._logprobs, []
        return delta

    def _text_delta(self, ev: TokenEvent) -> Delta | None:
        text = ""
        self._scheduler_done |= ev.finish_reason is not None
        if ev.token_id is not None:
            if ev.index < self._next_index:
                self.metrics.duplicates.inc()
                return None
            self._next_index = ev.index + 1
            self._observe_token(ev)
            if not (ev.finish_reason == "stop" and ev.token_id in self._end_ids):
                text = self._detok.add(ev.token_id)
                if self._logprobs is not None and ev.logprob is not None:
                    self._logprobs.append(TokenLogprob(ev.token_id, ev.logprob, ev.top_logprobs or []))
        if ev.finish_reason == "error":
            return self._finish("error", "", self._client_error(ev.error))
        if ev.finish_reason is not None:
            text += self._detok.flush()
        out, matched = self._stops.feed(text)
        if matched:
            return self._finish("stop", out)
        if ev.finish_reason is not None:
            return self._finish(ev.finish_reason, out + self._stops.flush())
        return Delta(out, self.num_tokens) if out else None

    def _client_error(self, error: str | None) -> str:
        """The error text the client sees. The scheduler's own messages (a worker that does not
        answer, a failed KV transfer) go through; one that carries an exception's text (prefix
        "internal error") is logged here and answered without it."""
        if not error:
            return "generation failed"
        if error.startswith(INTERNAL_ERROR):
            log.error("request %s failed: %s", self.req.req_id, error)
            return f"{INTERNAL_ERROR} (the server's log has the details)"
        return error

    def _observe_token(self, ev: TokenEvent) -> None:
        t = time.time()
        self.num_tokens += 1
        self.metrics.generation_tokens.inc()
        if self._last_token_time is None:
            self.metrics.ttft.observe(max(0.0, t - self.req.arrival_time))
            if ev.scheduled_time is not None:
                self.metrics.queue_time.observe(max(0.0, ev.scheduled_time - self.req.arrival_time))
        else:
            self.metrics.itl.observe(t - self._last_token_time)
        self._last_token_time = t

    def _finish(self, reason: str, text: str, error: str | None = None) -> Delta:
        self.finish_reason, self.error = reason, error
        return Delta(text, self.num_tokens, reason, error)

    def fail(self, message: str) -> None:
        """End this request with an error event of the gateway's own (nothing else will)."""
        self._events.put_nowait(TokenEvent(self.req.req_id, self._next_index, None, "error", message))

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self, reason_if_unfinished: str = "cancelled") -> None:
        """End the request's life here: stop routing its events, abort it unless the scheduler
        already ended it (a stop string matched, or the client left), record the metrics.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.dispatcher.close(self.req.req_id)
        self._events.put_nowait(None)  # ends a deltas() still waiting (e.g. another choice's pump)
        if not self._started:
            return
        if not self._scheduler_done:
            try:
                await self.queue.abort(self.req.req_id)
            except Exception:  # noqa: BLE001 - the scheduler still ends it by max_tokens
                log.warning("could not send abort for %s", self.req.req_id, exc_info=True)
        reason = self.finish_reason or reason_if_unfinished
        self.metrics.in_flight.dec()
        self.metrics.finished.labels(reason=reason).inc()
        if self.finish_reason is not None and reason != "error":
            self.metrics.e2e.observe(max(0.0, time.time() - self.req.arrival_time))
