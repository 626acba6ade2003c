"""The scheduler's side of the Redis queue (key layout: shared.queue.redis_streams)."""
from __future__ import annotations

import functools
import logging
import time

import redis

from shared.messages import RequestMsg, TokenEvent
from shared.queue.base import QueueConfig, QueueUnavailableError, SchedulerQueue
from shared.queue.common import RecentIds, decode_request, encode_events, now, stamp_scheduled
from shared.queue.redis_streams import PAGE, client_options, entries_of, is_busygroup

log = logging.getLogger(__name__)


def _unavailable_as_queue_error(method):
    """Redis down / restarting -> QueueUnavailableError (the service retries); a stream or group
    gone with a restarted Redis is re-created instead of failing."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
            raise QueueUnavailableError(f"Redis unavailable: {exc}") from exc
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):  # also inside a pipeline's "Command # n (...) caused error"
                raise
            self._ensure_group()
            return method(self, *args, **kwargs)
    return wrapper


class RedisSchedulerQueue(SchedulerQueue):
    """One scheduler replica's view of the queue. Not thread-safe: one loop thread uses it."""

    def __init__(self, url: str, config: QueueConfig, consumer: str):
        self.r = redis.Redis.from_url(url, **client_options(asyncio=False))
        self.cfg, self.consumer = config, consumer
        # req_id -> its stream entry ids, while pending here (more than one when a gateway
        # resubmitted it after a Redis restart: all are acked together at its end)
        self._entry_ids: dict[str, list[str]] = {}
        self._reply_to: dict[str, str] = {}     # req_id -> gateway id
        self._taken_at: dict[str, float] = {}   # req_id -> time.time() when fetched/replayed
        self._recent_aborts = RecentIds(config.aborts_maxlen)
        self._abort_buffer: list[str] = []
        self._aborts_cursor = "0-0"
        self._last_heartbeat = float("-inf")
        self._ensure_group()
        # The backlog only filters; it is not news to poll. No heartbeat yet: the scheduler
        # counts as alive (gateway /ready) once its loop calls fetch/poll/replay.
        self._read_aborts(buffer=False)

    # -- requests ------------------------------------------------------------------------------
    def _ensure_group(self) -> None:
        try:
            self.r.xgroup_create(self.cfg.requests_key, self.cfg.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if not is_busygroup(exc):
                raise

    @_unavailable_as_queue_error
    def fetch(self, max_n: int, block_ms: int = 0) -> list[RequestMsg]:
        self._maybe_heartbeat()
        if max_n <= 0:
            return []
        # BLOCK 0 means "forever" to Redis; our 0 means "do not wait".
        block = block_ms if block_ms > 0 else None
        try:
            resp = self.r.xreadgroup(self.cfg.group, self.consumer, {self.cfg.requests_key: ">"},
                                     count=max_n, block=block)
        except redis.ResponseError as exc:
            if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
                raise
            self._ensure_group()  # the stream was deleted under us (e.g. FLUSHDB)
            return []
        entries = entries_of(resp)
        if entries:
            self._read_aborts()  # an abort sent before we read may name one of these
        return self._accept(entries)

    @_unavailable_as_queue_error
    def replay_pending(self) -> list[RequestMsg]:
        self._maybe_heartbeat()
        self._read_aborts()
        entries: list[tuple[str, dict]] = []
        start = "0"
        while True:  # this consumer's own PEL, re-read from the beginning
            page = entries_of(self.r.xreadgroup(self.cfg.group, self.consumer,
                                              {self.cfg.requests_key: start}, count=PAGE))
            if not page:
                break
            entries += page
            start = page[-1][0]
        cursor = "0-0"
        while True:  # then everything a dead consumer left idle long enough
            resp = self.r.xautoclaim(self.cfg.requests_key, self.cfg.group, self.consumer,
                                     self.cfg.claim_min_idle_ms, cursor, count=PAGE)
            cursor, claimed = resp[0], resp[1]
            entries += claimed
            if cursor == "0-0":
                break
        unique = {eid: (eid, fields) for eid, fields in entries}  # own entries may be claimed too
        return self._accept(list(unique.values()))

    def _accept(self, entries: list[tuple[str, dict]]) -> list[RequestMsg]:
        """Entries -> requests now pending here. Deleted, malformed and already-aborted entries
        are acked (and deleted) instead of returned."""
        out, drop = [], []
        taken = now()
        for eid, fields in entries:
            try:
                req = decode_request(fields["req"]) if fields else None
            except Exception:  # noqa: BLE001 - a bad entry must not wedge the consumer
                log.exception("dropping malformed request entry %s", eid)
                req = None
            if req is None or req.req_id in self._recent_aborts:
                drop.append(eid)
                continue
            eids = self._entry_ids.setdefault(req.req_id, [])
            if eid not in eids:
                eids.append(eid)
            self._reply_to[req.req_id] = req.reply_to
            self._taken_at.setdefault(req.req_id, taken)
            out.append(req)
        if drop:
            self._ack_and_delete(drop)
        return out

    @_unavailable_as_queue_error
    def ack(self, req_id: str) -> None:
        eids = self._entry_ids.pop(req_id, None)
        self._reply_to.pop(req_id, None)
        self._taken_at.pop(req_id, None)
        if eids:
            self._ack_and_delete(eids)

    def _ack_and_delete(self, eids: list[str]) -> None:
        pipe = self.r.pipeline(transaction=True)  # ack and delete together: depth stays exact
        pipe.xack(self.cfg.requests_key, self.cfg.group, *eids)
        pipe.xdel(self.cfg.requests_key, *eids)
        pipe.execute()

    # -- events and aborts ---------------------------------------------------------------------
    @_unavailable_as_queue_error
    def publish(self, events: list[TokenEvent], reply_to: dict[str, str] | None = None) -> None:
        by_gateway: dict[str, list[TokenEvent]] = {}
        for ev in events:
            gw = (reply_to or {}).get(ev.req_id) or self._reply_to.get(ev.req_id)
            if gw is None:
                log.warning("no gateway known for %s; dropping its event", ev.req_id)
                continue
            by_gateway.setdefault(gw, []).append(ev)
        if not by_gateway:
            return
        stamp_scheduled(events, self._taken_at)
        pipe = self.r.pipeline(transaction=False)
        for gw, evs in by_gateway.items():
            key = self.cfg.out_key(gw)
            pipe.xadd(key, {"events": encode_events(evs)}, maxlen=self.cfg.out_maxlen, approximate=True)
            pipe.expire(key, self.cfg.out_ttl_s)
        pipe.execute()

    @_unavailable_as_queue_error
    def poll_aborts(self) -> list[str]:
        self._maybe_heartbeat()
        self._read_aborts()
        out, self._abort_buffer = self._abort_buffer, []
        return out

    def _read_aborts(self, buffer: bool = True) -> None:
        while True:
            entries = entries_of(self.r.xread({self.cfg.aborts_key: self._aborts_cursor}, count=PAGE))
            for eid, fields in entries:
                self._aborts_cursor = eid
                req_id = fields.get("req_id")
                if req_id:
                    self._recent_aborts.add(req_id)
                    if buffer:
                        self._abort_buffer.append(req_id)
            if len(entries) < PAGE:
                return

    # -- liveness ------------------------------------------------------------------------------
    def _maybe_heartbeat(self) -> None:
        if time.monotonic() - self._last_heartbeat >= self.cfg.heartbeat_interval_s:
            self.heartbeat()

    @_unavailable_as_queue_error
    def heartbeat(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.sadd(self.cfg.schedulers_key, self.consumer)
        pipe.set(self.cfg.heartbeat_key(self.consumer), str(now()), px=int(self.cfg.heartbeat_ttl_s * 1000))
        if self._entry_ids:  # XCLAIM to ourselves resets the idle time: nobody XAUTOCLAIMs them
            pipe.xclaim(self.cfg.requests_key, self.cfg.group, self.consumer, 0,
                        [e for eids in self._entry_ids.values() for e in eids], justid=True)
        pipe.execute()
        self._last_heartbeat = time.monotonic()

    def close(self) -> None:
        try:
            self.r.delete(self.cfg.heartbeat_key(self.consumer))
        except redis.RedisError:
            pass
        self.r.close()
