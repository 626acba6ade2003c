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
from shared.queue.base import GatewayQueue, QueueConfig, QueueFullError, SchedulerQueue
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
        self.epochs: dict[str, int] = {}                # req_id -> its current owner's epoch
        self.gateways: set[str] = set()                 # gateways holding a lease (open ones)
        self._outboxes: dict[str, _Outbox] = {}

    def take(self, req_id: str) -> int:
        """A consumer takes req_id: its next epoch. Call with `cond` held."""
        epoch = self.epochs[req_id] = self.epochs.get(req_id, 0) + 1
        return epoch

    def outbox(self, gateway_id: str) -> _Outbox:
        with self.cond:
            box = self._outboxes.get(gateway_id)
            if box is None:
                box = self._outboxes[gateway_id] = _Outbox(self.cfg.out_maxlen)
            return box


class LocalGatewayQueue(GatewayQueue):
    """The gateway's side. Its lease lasts from construction to close()."""

    def __init__(self, broker: LocalBroker, gateway_id: str):
        self.broker, self.gateway_id = broker, gateway_id
        self._epochs: dict[str, int] = {}  # req_id -> highest epoch seen (the fence)
        self.fenced = 0
        with broker.cond:
            broker.gateways.add(gateway_id)

    async def submit(self, req: RequestMsg) -> None:
        b = self.broker
        with b.cond:
            if len(b.waiting) + len(b.pending) >= b.cfg.requests_maxlen:
                raise QueueFullError(f"the request queue is full ({b.cfg.requests_maxlen} entries)")
            b.gateways.add(self.gateway_id)
            b.waiting.append(req)
            b.cond.notify_all()

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
                if ev.epoch:
                    seen = self._epochs.get(ev.req_id, 0)
                    if ev.epoch < seen:
                        self.fenced += 1
                        continue
                    self._epochs[ev.req_id] = ev.epoch
                    if ev.finish_reason is not None and len(self._epochs) > 65_536:
                        self._epochs.clear()  # bounded; late events of ended requests reach no route
                yield ev

    async def depth(self) -> int:
        with self.broker.cond:
            return len(self.broker.waiting)

    async def scheduler_alive(self) -> bool:
        with self.broker.cond:
            beats = list(self.broker.heartbeats.values())
        return any(time.monotonic() - t < self.broker.cfg.heartbeat_ttl_s for t in beats)

    async def close(self) -> None:
        with self.broker.cond:
            self.broker.gateways.discard(self.gateway_id)


class LocalSchedulerQueue(SchedulerQueue):
    """The scheduler's side. Its per-request state is guarded by the broker's lock, so the
    heartbeat may come from another thread."""

    def __init__(self, broker: LocalBroker, consumer: str):
        self.broker, self.consumer, self.cfg = broker, consumer, broker.cfg
        self._epochs: dict[str, int] = {}   # req_id -> this consumer's epoch of it
        self._lost: list[str] = []
        self._recent_lost = RecentIds(broker.cfg.aborts_maxlen)
        with broker.cond:
            broker.abort_buffers.setdefault(consumer, [])

    def _own(self, req_id: str) -> None:
        """Take req_id (cond held): the next epoch, unless it is already ours."""
        if req_id not in self._epochs:
            self._epochs[req_id] = self.broker.take(req_id)
            self._recent_lost.discard(req_id)

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
                self._own(req.req_id)
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
                    b.epochs.pop(req_id, None)
                elif p.consumer == self.consumer or time.monotonic() - p.touched >= idle_s:
                    p.consumer, p.touched = self.consumer, time.monotonic()
                    self._own(req_id)
                    out.append(p.req)
            return out

    def ack(self, req_id: str) -> None:
        """Only a request pending under this consumer: one claimed away is its new owner's."""
        b = self.broker
        with b.cond:
            p = b.pending.get(req_id)
            if p is not None and p.consumer == self.consumer:
                del b.pending[req_id]
                b.epochs.pop(req_id, None)
            self._epochs.pop(req_id, None)

    def take_lost(self) -> list[str]:
        with self.broker.cond:
            out, self._lost = self._lost, []
        return out

    def _forget_lost(self, req_id: str) -> None:
        """cond held: another consumer owns req_id now."""
        if self._epochs.pop(req_id, None) is not None:
            self._recent_lost.add(req_id)
            self._lost.append(req_id)

    def _stale(self, req_id: str) -> bool:
        """cond held: req_id was ours and its epoch is another's now."""
        mine = self._epochs.get(req_id)
        cur = self.broker.epochs.get(req_id)
        return mine is not None and cur is not None and cur != mine

    def dead_gateways(self, gateway_ids: set[str]) -> set[str]:
        with self.broker.cond:
            return set(gateway_ids) - self.broker.gateways

    def publish(self, events: list[TokenEvent], reply_to: dict[str, str] | None = None) -> None:
        b = self.broker
        by_gateway: dict[str, list[TokenEvent]] = {}
        with b.cond:
            taken_at = {e.req_id: b.pending[e.req_id].taken_at for e in events if e.req_id in b.pending}
            for ev in events:
                if ev.req_id in self._recent_lost:
                    continue
                if self._stale(ev.req_id):
                    self._forget_lost(ev.req_id)
                    continue
                ev.epoch = self._epochs.get(ev.req_id, 0)
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
        b = self.broker
        with b.cond:
            b.heartbeats[self.consumer] = t
            for req_id in list(self._epochs):
                p = b.pending.get(req_id)
                if (p is not None and p.consumer != self.consumer) or self._stale(req_id):
                    self._forget_lost(req_id)
            for p in b.pending.values():
                if p.consumer == self.consumer:
                    p.touched = t

    def close(self) -> None:
        with self.broker.cond:
            self.broker.heartbeats.pop(self.consumer, None)
