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

from starlette.responses import StreamingResponse
from starlette.types import Message, Send

log = logging.getLogger(__name__)


class TimedStreamingResponse(StreamingResponse):
    """A StreamingResponse whose every send must complete within send_timeout_s seconds (None:
    no bound). `dropped` tells whether the stream was cut for a slow reader."""

    def __init__(self, content, *, send_timeout_s: float | None, **kwargs):
        super().__init__(content, **kwargs)
        self.send_timeout_s = send_timeout_s
        self.dropped = False

    async def stream_response(self, send: Send) -> None:
        if self.send_timeout_s is None:
            return await super().stream_response(send)
        # A watchdog rather than a timeout around each send: a send costs two assignments here,
        # not a timer (or, before Python 3.12, a task) per event.
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        pending_since: float | None = None

        async def tracked_send(message: Message) -> None:
            nonlocal pending_since
            pending_since = loop.time()
            await send(message)
            pending_since = None

        async def watchdog() -> None:
            while True:
                await asyncio.sleep(self.send_timeout_s / 4)
                if pending_since is not None and loop.time() - pending_since > self.send_timeout_s:
                    self.dropped = True
                    task.cancel()
                    return

        dog = asyncio.ensure_future(watchdog())
        try:
            await super().stream_response(tracked_send)
        except asyncio.CancelledError:
            if not self.dropped:
                raise
            task.uncancel()   # our own cancel: end this stream, not the server's task
            log.warning("dropped a stream: its client read nothing for %.1f s", self.send_timeout_s)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()   # runs the generator's cleanup (aborts the requests)
        finally:
            dog.cancel()
