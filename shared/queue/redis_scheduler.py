"""The scheduler's side of the Redis queue (key layout: shared.queue.redis_streams).

The owner/epoch fence is kept by two scripts, each atomic on the server: the heartbeat refreshes
(XCLAIM to itself, which resets their idle time) only the entries still pending under this
consumer, at this consumer's epoch, and names the requests that are not (claimed away); publish
sends a request's events only while the request's epoch is still this consumer's.
"""
from __future__ import annotations

import functools
import logging
import threading
import time

import redis

from shared.messages import RequestMsg, TokenEvent
from shared.queue.base import QueueConfig, QueueUnavailableError, SchedulerQueue
from shared.queue.common import RecentIds, decode_request, encode_events, now, stamp_scheduled
from shared.queue.redis_streams import PAGE, client_options, entries_of, is_busygroup

log = logging.getLogger(__name__)

# KEYS: requests stream, epochs hash. ARGV: group, consumer, then (entry id, req_id, epoch) triples.
# Returns the req_ids owned elsewhere now: pending under another consumer, or at another epoch.
_HEARTBEAT = """
local mine, lost = {}, {}
for i = 3, #ARGV, 3 do
  local eid, rid, epoch = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], eid, eid, 1)
  local cur = redis.call('HGET', KEYS[2], rid)
  if (p[1] and p[1][2] ~= ARGV[2]) or (cur and cur ~= epoch) then
    lost[#lost + 1] = rid
  elseif p[1] then
    mine[#mine + 1] = eid
  end
end
for i = 1, #mine, 1000 do
  local cmd = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
  for j = i, math.min(i + 999, #mine) do cmd[#cmd + 1] = mine[j] end
  cmd[#cmd + 1] = 'JUSTID'
  redis.call(unpack(cmd))
end
return lost
"""

# KEYS: epochs hash, the gateway's reply stream. ARGV: out_maxlen, out_ttl_s, the events (one JSON
# list), and the fenced requests among them as one string "req_id\nepoch\n" per request (one
# argument and one HMGET, not two arguments and an HGET per request). If any of those has another
# epoch in the hash, nothing is sent and those req_ids are returned (the caller sends the rest
# again); else the events go out as one entry. A missing epoch is not a conflict: the owner acked
# (the gateway's own fence drops what is late), or Redis restarted empty.
_PUBLISH = """
local ids, eps, stale = {}, {}, {}
for rid, ep in string.gmatch(ARGV[4], '([^\\n]+)\\n([^\\n]+)\\n') do
  ids[#ids + 1] = rid
  eps[#eps + 1] = ep
end
for i = 1, #ids, 1000 do
  local last = math.min(i + 999, #ids)
  local cur = redis.call('HMGET', KEYS[1], unpack(ids, i, last))
  for j = i, last do
    local c = cur[j - i + 1]
    if c and c ~= eps[j] then stale[#stale + 1] = ids[j] end
  end
end
if #stale == 0 then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'events', ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end
return stale
"""

# KEYS: requests stream, epochs hash. ARGV: group, req_id, this consumer's epoch, entry ids.
# Acks and deletes the entries (and forgets the epoch) only while the epoch is still ours.
_ACK = """
local cur = redis.call('HGET', KEYS[2], ARGV[2])
if cur and cur ~= ARGV[3] then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 4))
redis.call('XDEL', KEYS[1], unpack(ARGV, 4))
redis.call('HDEL', KEYS[2], ARGV[2])
return 1
"""


def _unavailable_as_queue_error(method):
    """Redis down / restarting -> QueueUnavailableError (the service retries); a stream or group
    gone with a restarted Redis is re-created, and scripts it forgot are loaded again, instead of
    failing (the call is made once more: a publish may then repeat events, which the gateway
    drops by index)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
            raise QueueUnavailableError(f"Redis unavailable: {exc}") from exc
        except redis.ResponseError as exc:
            # also inside a pipeline's "Command # n (...) caused error"
            if isinstance(exc, redis.exceptions.NoScriptError):
                self._load_scripts()
            elif "NOGROUP" in str(exc):
                self._ensure_group()
            else:
                raise
            return method(self, *args, **kwargs)
    return wrapper


class RedisSchedulerQueue(SchedulerQueue):
    """One scheduler replica's view of the queue. One loop thread calls everything but
    heartbeat, which a heartbeat thread may call too (the per-request maps are behind a lock)."""

    def __init__(self, url: str, config: QueueConfig, consumer: str):
        self.r = redis.Redis.from_url(url, **client_options(asyncio=False, url=url))
        self.cfg, self.consumer = config, consumer
        self._lock = threading.Lock()
        # req_id -> its stream entry ids, while pending here (more than one when a gateway
        # resubmitted it after a Redis restart: all are acked together at its end)
        self._entry_ids: dict[str, list[str]] = {}
        self._epochs: dict[str, int] = {}       # req_id -> this consumer's epoch of it
        self._lost: list[str] = []              # claimed away, not yet taken by take_lost
        self._recent_lost = RecentIds(config.aborts_maxlen)  # their late events are dropped
        self._reply_to: dict[str, str] = {}     # req_id -> gateway id
        self._taken_at: dict[str, float] = {}   # req_id -> time.time() when fetched/replayed
        # EVALSHA in pipelines by hand: a registered Script would check SCRIPT EXISTS on every
        # pipeline execute (one more round trip per publish)
        self._heartbeat_sha = self._publish_sha = self._ack_sha = ""
        self._load_scripts()
        self._recent_aborts = RecentIds(config.aborts_maxlen)
        self._abort_buffer: list[str] = []
        self._aborts_cursor = "0-0"
        self._last_heartbeat = float("-inf")
        self._ensure_group()
        # The backlog only filters; it is not news to poll. No heartbeat yet: the scheduler
        # counts as alive (gateway /ready) once its loop calls fetch/poll/replay.
        self._read_aborts(buffer=False)

    # -- requests ------------------------------------------------------------------------------
    def _load_scripts(self) -> None:
        self._heartbeat_sha = self.r.script_load(_HEARTBEAT)
        self._publish_sha = self.r.script_load(_PUBLISH)
        self._ack_sha = self.r.script_load(_ACK)

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
        are acked (and deleted) instead of returned. A request new here gets the next epoch
        (fetched: 1; claimed from another consumer: one more than that one's); one already held
        here (a replay of our own, a resubmission) keeps its epoch."""
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
            out.append((eid, req))
        if drop:
            self._ack_and_delete(drop)
        with self._lock:
            held = dict.fromkeys(r.req_id for _, r in out if r.req_id in self._epochs)
            new = list(dict.fromkeys(r.req_id for _, r in out if r.req_id not in held))
            held_epochs = {r: self._epochs[r] for r in held}
        if new or held:
            pipe = self.r.pipeline(transaction=True)
            for req_id in new:
                pipe.hincrby(self.cfg.epochs_key, req_id, 1)
            for req_id, epoch in held_epochs.items():  # a Redis restarted empty lost the hash
                pipe.hsetnx(self.cfg.epochs_key, req_id, epoch)
            epochs = pipe.execute()[:len(new)]
            with self._lock:  # entries and epoch together: the heartbeat sees both or neither
                self._epochs.update(zip(new, epochs))
                for req_id in new:
                    self._recent_lost.discard(req_id)  # claimed back: ours again
                for eid, req in out:
                    eids = self._entry_ids.setdefault(req.req_id, [])
                    if eid not in eids:
                        eids.append(eid)
        for _, req in out:
            self._reply_to[req.req_id] = req.reply_to
            self._taken_at.setdefault(req.req_id, taken)
        return [req for _, req in out]

    @_unavailable_as_queue_error
    def ack(self, req_id: str) -> None:
        """Only while the request is ours (its epoch): one claimed away meanwhile is left to its
        new owner. Local state goes only once Redis answered, so a failed ack can be retried."""
        with self._lock:
            eids = list(self._entry_ids.get(req_id) or ())
            epoch = self._epochs.get(req_id)
        if eids and epoch is None:
            self._ack_and_delete(eids)
        elif eids and not self.r.evalsha(self._ack_sha, 2, self.cfg.requests_key, self.cfg.epochs_key,
                                         self.cfg.group, req_id, epoch, *eids):
            log.info("request %s was claimed by another scheduler before its ack", req_id)
        with self._lock:
            self._entry_ids.pop(req_id, None)
            self._epochs.pop(req_id, None)
        self._reply_to.pop(req_id, None)
        self._taken_at.pop(req_id, None)

    def _ack_and_delete(self, eids: list[str]) -> None:
        pipe = self.r.pipeline(transaction=True)  # ack and delete together: depth stays exact
        pipe.xack(self.cfg.requests_key, self.cfg.group, *eids)
        pipe.xdel(self.cfg.requests_key, *eids)
        pipe.execute()

    def take_lost(self) -> list[str]:
        with self._lock:
            out, self._lost = self._lost, []
        return out

    def _forget_lost(self, req_ids) -> None:
        """Requests another consumer owns now: forget them (no ack: they are not ours)."""
        with self._lock:
            for req_id in req_ids:
                if self._epochs.pop(req_id, None) is None:
                    continue
                self._entry_ids.pop(req_id, None)
                self._recent_lost.add(req_id)
                self._lost.append(req_id)
                log.warning("request %s was claimed by another scheduler; dropping it here", req_id)

    @_unavailable_as_queue_error
    def dead_gateways(self, gateway_ids: set[str]) -> set[str]:
        ids = sorted(gateway_ids)
        if not ids:
            return set()
        pipe = self.r.pipeline(transaction=False)
        for gw in ids:
            pipe.exists(self.cfg.gateway_key(gw))
        return {gw for gw, alive in zip(ids, pipe.execute()) if not alive}

    # -- events and aborts ---------------------------------------------------------------------
    @_unavailable_as_queue_error
    def publish(self, events: list[TokenEvent], reply_to: dict[str, str] | None = None) -> None:
        by_gateway: dict[str, list[TokenEvent]] = {}
        with self._lock:
            epochs = {e.req_id: self._epochs.get(e.req_id, 0) for e in events}
        for ev in events:
            if ev.req_id in self._recent_lost:
                continue  # claimed away: the new owner speaks for it
            gw = (reply_to or {}).get(ev.req_id) or self._reply_to.get(ev.req_id)
            if gw is None:
                log.warning("no gateway known for %s; dropping its event", ev.req_id)
                continue
            ev.epoch = epochs[ev.req_id]
            by_gateway.setdefault(gw, []).append(ev)
        stamp_scheduled(events, self._taken_at)
        while by_gateway:  # again without the requests found claimed away, if any
            pipe = self.r.pipeline(transaction=False)
            for gw, evs in by_gateway.items():
                fenced = {e.req_id: e.epoch for e in evs if e.epoch}
                pipe.evalsha(self._publish_sha, 2, self.cfg.epochs_key, self.cfg.out_key(gw),
                             self.cfg.out_maxlen, self.cfg.out_ttl_s, encode_events(evs),
                             "".join(f"{r}\n{e}\n" for r, e in fenced.items()))
            refused = {gw: set(stale) for gw, stale in zip(by_gateway, pipe.execute()) if stale}
            if not refused:
                return
            self._forget_lost(set().union(*refused.values()))
            by_gateway = {gw: kept for gw, stale in refused.items()
                          if (kept := [e for e in by_gateway[gw] if e.req_id not in stale])}

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
        with self._lock:
            held = [(eid, req_id, self._epochs.get(req_id, 0))
                    for req_id, eids in self._entry_ids.items() for eid in eids]
        pipe = self.r.pipeline(transaction=False)
        pipe.sadd(self.cfg.schedulers_key, self.consumer)
        pipe.set(self.cfg.heartbeat_key(self.consumer), str(now()), px=int(self.cfg.heartbeat_ttl_s * 1000))
        if held:  # XCLAIM to ourselves resets the idle time: nobody XAUTOCLAIMs them
            args = [self.cfg.group, self.consumer] + [x for triple in held for x in triple]
            pipe.evalsha(self._heartbeat_sha, 2, self.cfg.requests_key, self.cfg.epochs_key, *args)
        results = pipe.execute()
        if held and results[-1]:
            self._forget_lost(set(results[-1]))
        self._last_heartbeat = time.monotonic()

    def close(self) -> None:
        try:
            self.r.delete(self.cfg.heartbeat_key(self.consumer))
        except redis.RedisError:
            pass
        self.r.close()
