"""Server-sent event responses that a slow reader cannot hold open.

A client that reads slower than its tokens come fills the socket's buffers; the server's next
send then waits until the client reads. Without a bound that wait lasts as long as the client
likes, while the request keeps generating and its events pile up. Here every send must finish
within `send_timeout_s` seconds; past that the stream ends: its generator is closed (which
aborts the request on the scheduler), nothing more is written, and the server closes the
connection. What stays buffered for the client is what the socket already held. A watchdog
checks the send in progress every quarter of the timeout, so a stream is dropped between 1 and
1.25 timeouts after its client stopped reading.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from starlette.responses import StreamingResponse
from starlette.types import Send

log = logging.getLogger(__name__)


class TimedStreamingResponse(StreamingResponse):
    """A StreamingResponse whose every send must complete within send_timeout_s seconds (None:
    no bound). `dropped` tells whether the stream was cut for a slow reader; on_drop() is called
    when it is (metrics)."""

    def __init__(self, content, *, send_timeout_s: float | None, on_drop: Callable[[], None] | None = None,
                 **kwargs):
        super().__init__(content, **kwargs)
        self.send_timeout_s, self.on_drop = send_timeout_s, on_drop
        self.dropped = False

    async def stream_response(self, send: Send) -> None:
        if self.send_timeout_s is None:
            return await super().stream_response(send)
        # Starlette's loop, with the send in progress marked inline and a watchdog per stream
        # rather than a timeout per send: two assignments per event, no timer or wrapper.
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        self._sending_since: float | None = None
        dog = asyncio.ensure_future(self._watch(loop, task))
        try:
            self._sending_since = loop.time()
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                if not isinstance(chunk, bytes | memoryview):
                    chunk = chunk.encode(self.charset)
                self._sending_since = loop.time()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._sending_since = None
            self._sending_since = loop.time()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self.dropped:
                raise
            task.uncancel()   # our own cancel: end this stream, not the server's task
            log.warning("dropped a stream: its client read nothing for %.1f s", self.send_timeout_s)
            if self.on_drop is not None:
                self.on_drop()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()   # runs the generator's cleanup (aborts the requests)
        finally:
            dog.cancel()

    async def _watch(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
        """Cancel `task` once one send has waited longer than send_timeout_s."""
        while True:
            await asyncio.sleep(self.send_timeout_s / 4)
            since = self._sending_since
            if since is not None and loop.time() - since > self.send_timeout_s:
                self.dropped = True
                task.cancel()
                return
