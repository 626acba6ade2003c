"""The queue's contract (see shared.queue for the semantics both implementations keep): the two
sides' abstract classes (GatewayQueue, SchedulerQueue), their config and errors, and the ids a
process is known by. A leaf of the package: the implementations (local, redis_streams,
redis_scheduler) import it, and shared.queue re-exports it beside the factories that pick an
implementation.
"""
from __future__ import annotations

import abc
import os
import socket
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from shared.messages import RequestMsg, TokenEvent


class QueueResetError(RuntimeError):
    """Raised by GatewayQueue.events() when the queue's server lost its contents (Redis came
    back as a new instance: its run_id changed). Requests submitted before may be gone; the
    gateway resubmits its unfinished ones (the scheduler skips those it already runs). Calling
    events() again resumes the stream."""


class QueueUnavailableError(ConnectionError):
    """The queue's server cannot be reached right now (Redis down or restarting). Retry later;
    nothing was lost by the failed call except what it says."""


class QueueFullError(RuntimeError):
    """submit refused: the request stream holds QueueConfig.requests_maxlen entries already.
    Nothing was queued; the gateway answers 503 and the client retries later."""


@dataclass
class QueueConfig:
    """Names and timings of the queue. All Redis keys start with `prefix`.

    claim_min_idle_ms: ms; a pending request another consumer has not touched for this long is
        claimed by `replay_pending` (XAUTOCLAIM). Live schedulers refresh their pending entries
        every heartbeat, so only a dead replica's entries get that idle.
    heartbeat_interval_s: seconds between heartbeats (done inside fetch/poll_aborts/heartbeat).
    heartbeat_ttl_s: seconds a scheduler counts as alive after its last heartbeat (/ready).
    out_maxlen: approximate cap, in entries, of each gateway's reply stream (MAXLEN ~).
    out_ttl_s: seconds a reply stream lives after its last publish (a dead gateway's stream
        expires instead of leaking).
    aborts_maxlen: approximate cap, in entries, of the abort stream.
    requests_maxlen: entries the request stream may hold (queued plus taken and not yet acked);
        a submit beyond it raises QueueFullError instead of growing Redis without bound.
    gateway_ttl_s: seconds a gateway's lease lives after its last refresh (it refreshes it about
        once a second while it reads its events, and on every submit). A scheduler aborts the
        requests of a gateway whose lease it found expired on two checks in a row: nobody is
        left to read their tokens.
    """

    prefix: str = "sarathi:"
    group: str = "schedulers"
    claim_min_idle_ms: int = 30_000
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 10.0
    out_maxlen: int = 100_000
    out_ttl_s: int = 3600
    aborts_maxlen: int = 10_000
    requests_maxlen: int = 100_000
    gateway_ttl_s: float = 15.0

    @property
    def requests_key(self) -> str:
        return f"{self.prefix}requests"

    @property
    def aborts_key(self) -> str:
        return f"{self.prefix}aborts"

    def out_key(self, gateway_id: str) -> str:
        return f"{self.prefix}out:{gateway_id}"

    def heartbeat_key(self, consumer: str) -> str:
        return f"{self.prefix}scheduler:{consumer}"

    def gateway_key(self, gateway_id: str) -> str:
        """A key with a TTL: the gateway's lease (see gateway_ttl_s)."""
        return f"{self.prefix}gateway:{gateway_id}"

    @property
    def epochs_key(self) -> str:
        """A hash req_id -> the epoch of its current owner (see SchedulerQueue.publish)."""
        return f"{self.prefix}epochs"

    @property
    def schedulers_key(self) -> str:
        """A set of every consumer name that ever sent a heartbeat."""
        return f"{self.prefix}schedulers"


def new_gateway_id() -> str:
    """A gateway id unique per process: a restarted gateway gets a fresh reply stream."""
    return f"gw-{uuid.uuid4().hex[:12]}"


def default_consumer_name() -> str:
    """Stable per host (a StatefulSet pod name, or the hostname), so that a restarted scheduler
    replica finds its own pending entries. Override with SARATHI_CONSUMER."""
    return os.environ.get("SARATHI_CONSUMER") or f"sched-{socket.gethostname()}"


class GatewayQueue(abc.ABC):
    """The gateway's side. All methods run on the gateway's asyncio loop."""

    gateway_id: str

    @abc.abstractmethod
    async def submit(self, req: RequestMsg) -> None:
        """Enqueue `req`; returns once it is durable. req.reply_to must be self.gateway_id.
        Raises QueueFullError (nothing queued) when the stream is at requests_maxlen. Also
        renews this gateway's lease (QueueConfig.gateway_ttl_s)."""

    @abc.abstractmethod
    async def abort(self, req_id: str) -> None:
        """Ask every scheduler to stop `req_id` (and never to start it, if still queued)."""

    @abc.abstractmethod
    def events(self) -> AsyncIterator[TokenEvent]:
        """Every TokenEvent addressed to this gateway, in publish order; runs until cancelled.
        May raise QueueResetError (then call it again) or a connection error.

        Fenced: once an event of a request arrived with epoch e, its events with an epoch below
        e (a previous owner's, still running after another replica claimed the request) are
        dropped here, so a request's output comes from one run at a time, never interleaved.
        While it runs it renews this gateway's lease."""

    @abc.abstractmethod
    async def depth(self) -> int:
        """Requests queued and not yet taken by any scheduler."""

    @abc.abstractmethod
    async def scheduler_alive(self) -> bool:
        """True if at least one scheduler heartbeat is younger than heartbeat_ttl_s."""

    async def close(self) -> None:
        """Release connections. Idempotent."""


class SchedulerQueue(abc.ABC):
    """The scheduler's side. Called from one thread (the scheduler's loop); blocking calls."""

    consumer: str

    @abc.abstractmethod
    def fetch(self, max_n: int, block_ms: int = 0) -> list[RequestMsg]:
        """Up to max_n requests never delivered before; waits up to block_ms ms (0: no wait)
        when none is queued. Call only when there is room for them."""

    @abc.abstractmethod
    def replay_pending(self) -> list[RequestMsg]:
        """This consumer's un-acked requests (after a restart), plus requests claimed from
        consumers idle longer than claim_min_idle_ms. Recompute them from the prompt."""

    @abc.abstractmethod
    def ack(self, req_id: str) -> None:
        """The request finished or was aborted: it leaves the pending set. Unknown ids: no-op."""

    @abc.abstractmethod
    def publish(self, events: list[TokenEvent], reply_to: dict[str, str] | None = None) -> None:
        """Send each event to its request's gateway. reply_to: req_id -> gateway id; ids not in
        it are looked up among the requests this queue delivered (unknown ones are dropped).

        The owner/epoch fence: every time a consumer takes a request (fetch, or a claim of
        another consumer's) its epoch goes up by one, and the events of a request delivered here
        carry this consumer's epoch. Events of a request whose current epoch is another (it was
        claimed away from this consumer) are not sent; the request is reported by take_lost().
        Events of ids this queue never delivered (an explicit reply_to) carry epoch 0: unfenced."""

    @abc.abstractmethod
    def poll_aborts(self) -> list[str]:
        """Request ids aborted by gateways since the last call (may include unknown ids)."""

    @abc.abstractmethod
    def heartbeat(self) -> None:
        """Mark this scheduler alive and keep its pending requests from being claimed. Done
        inside fetch/poll_aborts/replay_pending (so a scheduler is "alive" from its loop's first
        call, not from construction); the scheduler service also calls it from a thread of its
        own, so that a replica busy in one long batch keeps its requests. Thread-safe with the
        other methods. Only refreshes requests still owned here: one claimed away meanwhile is
        not taken back but reported by take_lost()."""

    def take_lost(self) -> list[str]:
        """Request ids another consumer claimed from this one since the last call. Their owner
        is now that consumer: stop running them and publish nothing more for them (publish
        drops their events anyway); do not ack them. The queue has forgotten them."""
        return []

    def dead_gateways(self, gateway_ids: set[str]) -> set[str]:
        """The subset of gateway_ids whose lease is not held right now (QueueConfig.gateway_ttl_s).
        A gateway that has not submitted anything has no lease: ask only about gateways of
        requests delivered here."""
        return set()

    def close(self) -> None:
        """Release connections. Idempotent."""
