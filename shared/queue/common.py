"""Pieces both queue implementations share: the recent-abort memory and the wire encoding."""
from __future__ import annotations

import json
import time
from collections import OrderedDict

from shared.messages import RequestMsg, TokenEvent


class RecentIds:
    """A bounded set of ids, oldest evicted first: the aborts a scheduler remembers so that a
    request aborted while still queued is dropped when it is finally fetched or replayed."""

    def __init__(self, maxlen: int):
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._maxlen = maxlen

    def add(self, req_id: str) -> None:
        self._ids[req_id] = None
        self._ids.move_to_end(req_id)
        while len(self._ids) > self._maxlen:
            self._ids.popitem(last=False)

    def discard(self, req_id: str) -> None:
        self._ids.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._ids


def stamp_scheduled(events: list[TokenEvent], taken_at: dict[str, float]) -> None:
    """Set scheduled_time on each request's first event (index 0) from the time the queue
    handed the request to the scheduler, unless the scheduler already set it. The gateway's
    queue-time metric reads it."""
    for ev in events:
        if ev.index == 0 and ev.scheduled_time is None and ev.req_id in taken_at:
            ev.scheduled_time = taken_at[ev.req_id]


def now() -> float:
    """Wall-clock seconds (time.time()): comparable with RequestMsg.arrival_time."""
    return time.time()


def encode_request(req: RequestMsg) -> str:
    return json.dumps(req.to_wire(), separators=(",", ":"))


def decode_request(data: str) -> RequestMsg:
    return RequestMsg.from_wire(json.loads(data))


def encode_events(events: list[TokenEvent]) -> str:
    return json.dumps([e.to_wire() for e in events], separators=(",", ":"))


def decode_events(data: str) -> list[TokenEvent]:
    return [TokenEvent.from_wire(d) for d in json.loads(data)]
