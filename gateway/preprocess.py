"""The CPU work of admitting a request (parsing its JSON body, tokenization, chat templates,
grammar compiles), run on a bounded pool of threads, off the event loop that streams every
other request's tokens.

Bounds, so that no burst of requests can queue unbounded work or hold a request forever:
* `workers` threads run jobs; at most `max_pending` jobs are admitted at once (running or
  waiting for a thread). One more is refused at once: 503, code `server_busy`, Retry-After.
* a job not done within `deadline_s` seconds is answered 503, code `preprocessing_timeout`. A
  thread cannot be interrupted, so the job finishes in the background and keeps its slot in
  `max_pending` until it does: the bound counts work, not waiting clients.

The tokenizers library releases the GIL while it encodes (shared.tokenizer) and llguidance while
it compiles, so these threads run beside the event loop rather than taking turns with it.
"""
from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.routing import APIRoute

from gateway.errors import APIError

log = logging.getLogger(__name__)
T = TypeVar("T")
INLINE_PARSE_BYTES = 16 << 10


@dataclass
class PreprocessConfig:
    """workers: threads. max_pending: jobs admitted at once (running + waiting).
    deadline_s: seconds a request waits for one job before a 503. retry_after_s: the
    Retry-After of the 503s (seconds)."""

    workers: int = 4
    max_pending: int = 64
    deadline_s: float = 10.0
    retry_after_s: int = 1


class Preprocessor:
    def __init__(self, cfg: PreprocessConfig | None = None):
        self.cfg = cfg or PreprocessConfig()
        self._pool = ThreadPoolExecutor(self.cfg.workers, thread_name_prefix="preprocess")
        self.pending = 0   # admitted jobs not yet finished (event-loop thread only)

    async def run(self, what: str, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the pool; its exceptions propagate. what: names the job in the 503s."""
        if self.pending >= self.cfg.max_pending:
            raise APIError(503, "the server is busy preparing other requests; retry later", code="server_busy",
                           headers={"Retry-After": str(self.cfg.retry_after_s)})
        # One wake-up of the loop per job (as asyncio.to_thread) and one timer: this runs for
        # every request, so no task or wait_for machinery around it.
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def settle(job: Future) -> None:      # on the loop
            self.pending -= 1
            if answer.done():                 # past its deadline, or the request went away
                return
            if job.cancelled():
                answer.cancel()
            elif job.exception() is not None:
                answer.set_exception(job.exception())
            else:
                answer.set_result(job.result())

        def finished(job: Future) -> None:    # on the pool's thread
            try:
                loop.call_soon_threadsafe(settle, job)
            except RuntimeError:  # the loop is closed: the server is gone, nothing to count
                pass

        def expire() -> None:
            if not answer.done():
                answer.set_exception(APIError(503, f"{what} did not finish within {self.cfg.deadline_s:g} s",
                                              code="preprocessing_timeout",
                                              headers={"Retry-After": str(self.cfg.retry_after_s)}))
                log.warning("%s did not finish within %.1f s", what, self.cfg.deadline_s)

        self.pending += 1
        self._pool.submit(fn, *args).add_done_callback(finished)
        timer = loop.call_later(self.cfg.deadline_s, expire)
        try:
            return await answer
        finally:
            timer.cancel()

    def close(self) -> None:
        """Drop the jobs still waiting; running ones finish in their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def off_loop_json_route(pre: Preprocessor, max_commas: int, max_colons: int,
                        authorize: Callable[[Request], Awaitable[None]] | None = None) -> type[APIRoute]:
    """A FastAPI route class whose JSON body is parsed on `pre`'s pool, not on the event loop.

    Parsing holds the GIL, so on a thread it still pauses the loop, but for one body at a time
    (threads take turns at the GIL) rather than for every body queued on the loop. A body with
    more than max_commas commas or max_colons colons (bounds on its JSON values and object
    members, so on the parse's cost) is a 400 before it is parsed. A body of at most
    INLINE_PARSE_BYTES is parsed on the loop (cheaper than the trip to a thread; about a
    millisecond at most). FastAPI then validates the parsed body as usual: Starlette's Request
    keeps a parsed body in `_json` and request.json() returns it. authorize(request) runs first
    (raising to refuse), so a client without the API key gets its 401 before its body is read."""

    class OffLoopJsonRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def parse_then_handle(request: Request):
                if authorize is not None:
                    await authorize(request)
                body = await request.body()
                if body and "json" in request.headers.get("content-type", "json"):
                    for sign, most, what in ((b",", max_commas, "commas (JSON values)"),
                                             (b":", max_colons, "colons (object members)")):
                        if body.count(sign) > most:
                            raise APIError(400, f"the request body has more than {most} {what}",
                                           code="too_many_values")
                    try:
                        request._json = (json.loads(body) if len(body) <= INLINE_PARSE_BYTES
                                         else await pre.run("parsing the request body", json.loads, body))
                    except (ValueError, RecursionError):  # not JSON (or nested too deep to parse):
                        pass                                 # FastAPI parses it again and answers 400
                return await handler(request)

            return parse_then_handle

    return OffLoopJsonRoute
