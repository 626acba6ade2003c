"""The in-process queue (embedded mode): the same semantics as the Redis one, without Redis.

One `LocalBroker` is shared by the gateway (asyncio loop) and the scheduler (its own thread).
All broker state sits behind one lock, held only for short bookkeeping, never while waiting on
the event loop. Events cross into the loop with `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator

from shared.messages import RequestMsg, TokenEvent
from shared.queue.base import GatewayQueue, QueueConfig, SchedulerQueue
from shared.queue.common import RecentIds, now, stamp_scheduled


@dataclass
class _Pending:
    """A request taken by a consumer and not yet acked. touched: time.monotonic() of the
    consumer's last heartbeat (or of the take), for the claim-when-idle rule."""

    req: RequestMsg
    consumer: str
    touched: float
    taken_at: float


class _Outbox:
    """One gateway's event stream: a bounded buffer plus a wake-up for its asyncio loop."""

    def __init__(self, maxlen: int):
        self._lock = threading.Lock()
        self._items: deque[TokenEvent] = deque(maxlen=maxlen)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None

    def put(self, events: list[TokenEvent]) -> None:
        with self._lock:
            self._items.extend(events)
            loop, wakeup = self._loop, self._wakeup
        if loop is not None:
            try:
                loop.call_soon_threadsafe(wakeup.set)
            except RuntimeError:  # the gateway's loop is closed: nobody is listening any more
                pass

    async def get(self) -> list[TokenEvent]:
        """Wait for and take everything buffered (at least one event)."""
        with self._lock:
            if self._loop is None:
                self._loop, self._wakeup = asyncio.get_running_loop(), asyncio.Event()
        while True:
            with self._lock:
                if self._items:
                    items = list(self._items)
                    self._items.clear()
                    return items
                self._wakeup.clear()  # under the lock: a put after this sets it again
            await self._wakeup.wait()


class LocalBroker:
    """The shared state of one process's queue."""

    def __init__(self, config: QueueConfig | None = None):
        self.cfg = config or QueueConfig()
        self.cond = threading.Condition()
        self.waiting: deque[RequestMsg] = deque()
        self.pending: dict[str, _Pending] = {}
        self.recent_aborts = RecentIds(self.cfg.aborts_maxlen)
        self.abort_buffers: dict[str, list[str]] = {}   # consumer -> aborts not yet polled
        self.heartbeats: dict[str, float] = {}          # consumer -> time.monotonic()
        self._outboxes: dict[str, _Outbox] = {}

    def outbox(self, gateway_id: str) -> _Outbox:
        with self.cond:
            box = self._outboxes.get(gateway_id)
            if box is None:
                box = self._outboxes[gateway_id] = _Outbox(self.cfg.out_maxlen)
            return box


class LocalGatewayQueue(GatewayQueue):
    def __init__(self, broker: LocalBroker, gateway_id: str):
        self.broker, self.gateway_id = broker, gateway_id

    async def submit(self, req: RequestMsg) -> None:
        with self.broker.cond:
            self.broker.waiting.append(req)
            self.broker.cond.notify_all()

    async def abort(self, req_id: str) -> None:
        b = self.broker
        with b.cond:
            b.recent_aborts.add(req_id)
            # Still queued: it simply never starts (Redis drops it at fetch; same effect).
            b.waiting = deque(r for r in b.waiting if r.req_id != req_id)
            for buf in b.abort_buffers.values():
                buf.append(req_id)

    async def events(self) -> AsyncIterator[TokenEvent]:
        box = self.broker.outbox(self.gateway_id)
        while True:
            for ev in await box.get():
                yield ev

    async def depth(self) -> int:
        with self.broker.cond:
            return len(self.broker.waiting)

    async def scheduler_alive(self) -> bool:
        with self.broker.cond:
            beats = list(self.broker.heartbeats.values())
        return any(time.monotonic() - t < self.broker.cfg.heartbeat_ttl_s for t in beats)


class LocalSchedulerQueue(SchedulerQueue):
    def __init__(self, broker: LocalBroker, consumer: str):
        self.broker, self.consumer = broker, consumer
        with broker.cond:
            broker.abort_buffers.setdefault(consumer, [])

    def fetch(self, max_n: int, block_ms: int = 0) -> list[RequestMsg]:
        self.heartbeat()
        b = self.broker
        if max_n <= 0:
            return []
        with b.cond:
            if not b.waiting and block_ms > 0:
                b.cond.wait_for(lambda: bool(b.waiting), timeout=block_ms / 1000)
            out = []
            while b.waiting and len(out) < max_n:
                req = b.waiting.popleft()
                if req.req_id in b.recent_aborts:
                    continue
                b.pending[req.req_id] = _Pending(req, self.consumer, time.monotonic(), now())
                out.append(req)
            return out

    def replay_pending(self) -> list[RequestMsg]:
        self.heartbeat()
        b = self.broker
        idle_s = b.cfg.claim_min_idle_ms / 1000
        with b.cond:
            out = []
            for req_id, p in list(b.pending.items()):
                if req_id in b.recent_aborts:
                    del b.pending[req_id]
                elif p.consumer == self.consumer or time.monotonic() - p.touched >= idle_s:
                    p.consumer, p.touched = self.consumer, time.monotonic()
                    out.append(p.req)
            return out

    def ack(self, req_id: str) -> None:
        with self.broker.cond:
            self.broker.pending.pop(req_id, None)

    def publish(self, events: list[TokenEvent], reply_to: dict[str, str] | None = None) -> None:
        b = self.broker
        by_gateway: dict[str, list[TokenEvent]] = {}
        with b.cond:
            taken_at = {e.req_id: b.pending[e.req_id].taken_at for e in events if e.req_id in b.pending}
            for ev in events:
                gw = (reply_to or {}).get(ev.req_id)
                if gw is None and ev.req_id in b.pending:
                    gw = b.pending[ev.req_id].req.reply_to
                if gw is not None:
                    by_gateway.setdefault(gw, []).append(ev)
        stamp_scheduled(events, taken_at)
        for gw, evs in by_gateway.items():
            b.outbox(gw).put(evs)

    def poll_aborts(self) -> list[str]:
        self.heartbeat()
        with self.broker.cond:
            buf = self.broker.abort_buffers[self.consumer]
            out, buf[:] = list(buf), []
            return out

    def heartbeat(self) -> None:
        t = time.monotonic()
        with self.broker.cond:
            self.broker.heartbeats[self.consumer] = t
            for p in self.broker.pending.values():
                if p.consumer == self.consumer:
                    p.touched = t

    def close(self) -> None:
        with self.broker.cond:
            self.broker.heartbeats.pop(self.consumer, None)
