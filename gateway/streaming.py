"""Server-sent event responses that a slow reader cannot hold open.

A client that reads slower than its tokens come fills the socket's buffers; the server's next
send then waits until the client reads. Without a bound that wait lasts as long as the client
likes, while the request keeps generating and its events pile up. Here every send must finish
within `send_timeout_s` seconds; past that the stream ends: its generator is closed (which
aborts the request on the scheduler), nothing more is written, and the server closes the
connection. What stays buffered for the client is what the socket already held.
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

        async def timed_send(message: Message) -> None:
            await asyncio.wait_for(send(message), self.send_timeout_s)

        try:
            await super().stream_response(timed_send)
        except TimeoutError:
            self.dropped = True
            log.warning("dropped a stream: its client read nothing for %.1f s", self.send_timeout_s)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()   # runs the generator's cleanup (aborts the requests)
