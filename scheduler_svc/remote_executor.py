"""The scheduler's side of the worker wire: an executor whose batches run on remote workers.

One DEALER socket and one `BatchEncoder` per worker address. Every batch goes to every worker
(all tensor/pipeline ranks get the same plan); the sampled tokens come from the last address
(the rank that samples). Each worker's mirror records only the tokens that worker sampled, so a
rank that does not sample is sent the decode tokens explicitly by the diff logic.

A tensor/pipeline-parallel replica (tp x pp ranks) is addressed by one address per rank, in rank
order, or by rank 0's address alone: its "info" reply names the replica's layout and the other
ranks are found at shared.config.rank_address().

One RPC path: `submit(batch)` sends without waiting and `collect()` returns the oldest batch's
output once every rank answered; `execute(batch)` is submit then collect. With pp > 1 the engine
loop (scheduler_svc.engine_loop) keeps up to pp micro-batches in flight; a single worker has one.
An error reply of any rank fails at once, without waiting for the others.

Liveness (one mechanism for every wait and every rank): each DEALER socket runs ZMTP
heartbeats (a PING every heartbeat_ivl_s, answered by the worker's libzmq I/O thread even while
the worker computes a batch; no answer within heartbeat_timeout_s closes the link) and a socket
monitor. A worker whose process dies drops its TCP/IPC connection at once, a silent one misses
its heartbeats: either way the monitor reports a disconnect and the wait for a reply ends with
WorkerLostError within about heartbeat_timeout_s, not after the reply timeout. A rank that saw a
peer die answers "rank_lost", which is a WorkerLostError too (the replica's KV is gone). ZeroMQ
reconnects by itself when a worker is back on the address.

Authentication and bounds: on tcp:// with link keys (shared.link_auth.process_keys("scheduler")
or `keys=`) every socket is a CURVE client that expects the workers' public key and presents the
scheduler's (a worker accepts no other client). A failed handshake is named in the errors.
Sockets are bounded (largest reply, queued messages, a send that cannot be queued within
timeout_s fails). Before a batch with KvSends is sent, each destination's KV receiver is told to
expect that transfer (shared.link_auth.kv_expect_msg); a transfer that failed or whose batch was
given up on is cancelled there, so its blocks cannot be written once the scheduler may reuse them.

Torch-free: the scheduler never imports torch.
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from shared import link_auth
from shared.config import ModelInfo, rank_address, single_rank_layout
from shared.link_auth import LinkKeys
from shared.messages import Batch, BatchOutput
from shared.wire import BatchEncoder, pack, unpack

# Each monitor's inproc endpoint gets its own name: pyzmq's default names it after the socket's file
# descriptor, which a renewed socket can reuse while the closed socket's monitor endpoint is still
# bound (the ZMQ reaper unbinds it asynchronously): bind then fails with "Address already in use".
_MONITOR_IDS = itertools.count()
log = logging.getLogger("sarathi.remote")

MAX_REPLY_BYTES = 64 << 20   # a batch's reply: sampled ids, timings, logprobs of every row
QUEUED_MSGS = 64             # per worker: the loop keeps pp batches (and a ping) in flight
_HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the worker refused this scheduler's key",
                     zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the handshake failed (link keys on one side only?)",
                     zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed (not the workers' public "
                                                           "key, or link keys on one side only?)"}


class WorkerError(RuntimeError):
    """A worker answered with an error, or did not answer within the timeout."""


class WorkerLostError(WorkerError):
    """A worker's link went down (its process died, or it stopped answering heartbeats): the
    batch in flight will never be answered and the worker's KV cache is gone."""


class WorkerRestartedError(WorkerError):
    """A worker process was replaced since the last reply: the KV content of every request that
    has computed tokens is lost, so those requests must be recomputed or failed."""


class WorkerLayoutError(ValueError):
    """The worker addresses do not match the replica's ranks (a configuration error)."""


@dataclass(eq=False)
class _Call:
    """One message sent to every rank (a batch, or an "info"/"ping" when batch is None): the seq
    its messages carry and the replies so far (one per rank)."""

    batch: Batch | None
    t0: float = 0.0                # perf_counter() at submit
    submitted_at: float = 0.0      # time.time() at submit
    seq: int = -1
    replies: list = field(default_factory=list)
    resent: bool = False           # sent once more in full after an "unknown_request"


def _monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A monitor of `sock` that can never stall the context: libzmq sends each event with a
    blocking send on an inproc PAIR, from the context's I/O thread, so once 1000 events wait
    unread (a link that flaps or keeps failing its handshake while nobody looks) that thread
    blocks and every socket of the context goes silent. The reading end is made unbounded
    (an inproc pipe is unbounded when either side's limit is 0); events are ~100 bytes and are
    drained on every look at the links."""
    addr = f"inproc://remote-executor-monitor-{next(_MONITOR_IDS)}"
    sock.monitor(addr, events)
    mon = sock.context.socket(zmq.PAIR)
    mon.rcvhwm = 0
    mon.linger = 0
    mon.connect(addr)
    return mon


def _retire(sock: zmq.Socket, mon: zmq.Socket | None) -> None:
    """Close a monitored link: its monitor is turned off before its reader goes. A reader that
    goes first leaves libzmq's event socket without a peer, and its next event (the link's own
    disconnect, emitted while the socket is torn down) is a send that blocks the context's I/O
    thread forever: every socket of the context goes silent."""
    if mon is not None and not sock.closed:
        sock.disable_monitor()
    sock.close(0)
    if mon is not None:
        mon.close(0)


def _close_links(socks: list, monitors: list, announcers: dict) -> None:
    """Every socket of an executor, in the order _retire needs (also when it is collected
    without close(): weakref.finalize holds these lists, so none of them goes first)."""
    for i, s in enumerate(socks):
        _retire(s, monitors[i])
        monitors[i] = None
    for s in announcers.values():
        s.close(0)
    announcers.clear()


class RemoteExecutor:
    """submit(batch) / collect() -> (batch, BatchOutput), and execute(batch), over ZeroMQ.

    addresses: one ZeroMQ address per worker rank, as a list or a comma-separated string.
    timeout_s: seconds to wait for every worker's reply to one message; a slow first batch on a
    CPU is still an answer, a dead worker is not, so keep it generous.
    heartbeat_ivl_s, heartbeat_timeout_s: the link liveness (see the module doc).
    keys: the scheduler's link keys ("env": shared.link_auth.process_keys("scheduler"); None: plain).
    """

    def __init__(self, addresses: str | list[str], timeout_s: float = 120.0,
                 ctx: zmq.Context | None = None, heartbeat_ivl_s: float = 0.5,
                 heartbeat_timeout_s: float = 1.5, keys: LinkKeys | None | str = "env"):
        if isinstance(addresses, str):  # "tcp://a:5555,tcp://b:5555" from a flag or env var
            addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
        self.ctx = ctx or zmq.Context.instance()
        self.keys = link_auth.process_keys("scheduler") if keys == "env" else keys
        self.handshake_failed: dict[int, str] = {}   # rank -> why its last handshake failed
        self._announcers: dict[str, zmq.Socket] = {}  # KV receiver address -> DEALER
        self.heartbeat_ivl_ms = int(heartbeat_ivl_s * 1000)
        self.heartbeat_timeout_ms = int(heartbeat_timeout_s * 1000)
        self.monitors: list[zmq.Socket | None] = [None] * len(self.addresses)
        self.connected = [False] * len(self.addresses)  # as the monitors last reported
        self.socks = [self._connect(i, a) for i, a in enumerate(self.addresses)]
        self.encoders = [BatchEncoder() for _ in self.addresses]
        self._seq = itertools.count()
        self._model_info: ModelInfo | None = None
        self._instances: list[str | None] = [None] * len(self.addresses)
        self.parallel: dict = single_rank_layout()
        self._inflight: deque[_Call] = deque()   # submitted batches, oldest first
        self.kv_address: str | None = None       # the worker's KV receiver (from its "info")
        self._finalizer = weakref.finalize(self, _close_links, self.socks, self.monitors, self._announcers)

    def _connect(self, i: int, address: str) -> zmq.Socket:
        """A fresh DEALER to worker i, with heartbeats and a monitor (inproc:// has neither:
        a worker thread cannot die alone). The link it replaces is retired first (_renew)."""
        s = link_auth.bound(self.ctx.socket(zmq.DEALER), max_msg_bytes=MAX_REPLY_BYTES, sndhwm=QUEUED_MSGS,
                            rcvhwm=QUEUED_MSGS, sndtimeo_ms=int(self.timeout_s * 1000))
        if link_auth.uses_curve(address, self.keys):
            link_auth.connect_curve(s, self.keys)
        if not address.startswith("inproc://"):
            s.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ivl_ms)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.heartbeat_timeout_ms)
            s.setsockopt(zmq.HEARTBEAT_TTL, self.heartbeat_timeout_ms)
            events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
            for e in _HANDSHAKE_FAILED:
                events |= e
            self.monitors[i] = _monitor(s, events)
        self.connected[i] = False
        s.connect(address)
        return s

    def _drain_monitor(self, i: int) -> bool:
        """Read worker i's pending monitor events; True if one of them is a disconnect."""
        mon, lost = self.monitors[i], False
        while mon is not None and mon.poll(0, zmq.POLLIN):
            event = recv_monitor_message(mon)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                # the end of a handshake that failed is no loss: that link was never up
                lost = lost or self.connected[i] or i not in self.handshake_failed
                self.connected[i] = False
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected[i] = True
                self.handshake_failed.pop(i, None)
            elif event in _HANDSHAKE_FAILED:
                self.handshake_failed[i] = _HANDSHAKE_FAILED[event]
        return lost

    def check_links(self) -> list[str]:
        """Addresses of workers whose link went down since the last look (non-blocking). The
        batches in flight then never complete: they are forgotten (abandon), and nothing queued
        for the dead peers is delivered to their replacements (fresh sockets)."""
        lost = [i for i in range(len(self.socks)) if self._drain_monitor(i)]
        if lost and self._inflight:
            for i in lost:
                self._renew(i)
            self.abandon()
        return [self.addresses[i] for i in lost]

    @property
    def model_info(self) -> ModelInfo:
        """The model the workers loaded (asked once; blocks up to timeout_s)."""
        if self._model_info is None:
            self._model_info = self.wait_ready(self.timeout_s)
        return self._model_info

    def wait_ready(self, timeout_s: float) -> ModelInfo:
        """Wait until every worker answers "info"; returns the first worker's ModelInfo. The
        workers' process instances answering become the expected ones (after a worker came
        back, the next batch is not mistaken for a restart), and every encoder starts a new
        epoch."""
        replies = self._call_all([{"op": "info"}] * len(self.socks), timeout_s)
        if self._check_layout(replies):   # rank 0 named more ranks: ask them all
            replies = self._call_all([{"op": "info"}] * len(self.socks), timeout_s)
            self._check_layout(replies)
        self._model_info = ModelInfo(**replies[0]["model_info"])
        self.kv_address = replies[0].get("kv_address")   # where this worker receives KV blocks
        if self._instances != [r.get("instance") for r in replies]:
            self._instances = [r.get("instance") for r in replies]
            self.reset()
        return self._model_info

    @property
    def pipeline_depth(self) -> int:
        """Micro-batches to keep in flight: the replica's pipeline stages (known after wait_ready)."""
        return int(self.parallel.get("pp", 1))

    def _check_layout(self, replies: list[dict[str, Any]]) -> bool:
        """Check that address i is rank i of one replica; True if the addresses were expanded
        from rank 0's alone (then ask again)."""
        layout = [r.get("parallel") or single_rank_layout() for r in replies]
        world = layout[0]["world_size"]
        if all(p["world_size"] == 1 for p in layout):
            return False   # independent one-rank workers, each sent every batch (as before)
        if world > 1 and len(self.addresses) == 1:
            for r in range(1, world):
                self.addresses.append(rank_address(self.addresses[0], r))
                self.monitors.append(None)   # the per-rank lists stay index-aligned
                self.connected.append(False)
                self._instances.append(None)
                self.encoders.append(BatchEncoder())
                self.socks.append(self._connect(len(self.socks), self.addresses[-1]))
            return True
        if len(self.addresses) != world or any(
                (p["rank"], p["world_size"], p["tp"], p["pp"]) != (i, world, layout[0]["tp"], layout[0]["pp"])
                for i, p in enumerate(layout)):
            raise WorkerLayoutError(
                "the worker addresses do not match the replica's ranks: "
                + "; ".join(f"{a} is rank {p['rank']} of {p['world_size']} (tp {p['tp']}, pp {p['pp']})"
                            for a, p in zip(self.addresses, layout))
                + ". List every rank's address in rank order, or rank 0's alone.")
        self.parallel = layout[0]
        return False

    def ping(self, timeout_s: float = 1.0) -> bool:
        """True when every worker answers within timeout_s seconds."""
        try:
            self._call_all([{"op": "ping"}] * len(self.socks), timeout_s)
            return True
        except WorkerError:
            return False

    # -- batches: one path, up to pipeline_depth in flight -----------------------------------------
    def execute(self, batch: Batch) -> BatchOutput:
        """Run one iteration: submit(batch), then collect() its output. Raises WorkerError (see
        collect); after an error every encoder starts a new epoch, so the next batch re-sends
        all requests in full."""
        if self._inflight:
            raise RuntimeError(f"execute() with {len(self._inflight)} batch(es) in flight: collect them")
        self.submit(batch)
        return self.collect()[1]

    def submit(self, batch: Batch) -> None:
        """Send `batch` to every rank and return at once; collect() returns outputs in submit
        order. The caller keeps the scheduler's invariant: a request is in at most one batch in
        flight (so each encoder's mirror sees a request's tokens before its next chunk)."""
        call = _Call(batch, time.perf_counter(), time.time())
        for send in batch.kv_sends:
            # the lease: the batch's own timeout plus the send's (after that the scheduler
            # releases the blocks, and cancels the announcement if it still stands)
            self._announce(send.dst_address, link_auth.kv_expect_msg(
                send.req_id, send.dst_blocks, min(link_auth.MAX_LEASE_S, self.timeout_s + send.timeout_s)))
        self._send(call, [enc.encode(batch) for enc in self.encoders])
        self._inflight.append(call)

    def collect(self) -> tuple[Batch, BatchOutput]:
        """(batch, output) of the oldest submitted batch, once every rank answered. The output is
        the last rank's (it samples), with each rank's timings added as rank<i>_<name>
        (start/end: time.time() seconds), rpc_s (seconds from submit to now) and submitted_at /
        collected_at (time.time()).

        A rank that answers "unknown_request" (it lost its mirror of a request: a restart) while
        this batch is the only one in flight gets the batch once more, every request in full
        (new epoch), with a fresh timeout. Raises WorkerLostError when a rank's link goes down
        (heartbeats/monitor) or a rank answers "rank_lost"; WorkerRestartedError when a rank's
        process changed since the last reply; WorkerError at another error reply (an
        "unknown_request" with other batches in flight included) or after timeout_s seconds
        without all replies. After any of these every batch in flight is lost and the next
        batch starts a new epoch."""
        if not self._inflight:
            raise RuntimeError("collect() with no batch in flight")
        head = self._inflight[0]
        try:
            self._wait(head, self.timeout_s)
            self._check_instances(head.replies)
        except WorkerError:
            self.abandon()
            raise
        self._inflight.popleft()
        outputs = [BatchOutput.from_wire(r) for r in head.replies]
        for send in head.batch.kv_sends:
            if send.req_id not in outputs[-1].kv_sent:   # given up on: its blocks go back
                self._announce(send.dst_address, link_auth.kv_cancel_msg(send.req_id))
        for enc, out in zip(self.encoders, outputs):
            enc.on_output(out)
        last = outputs[-1]
        last.timings.update({f"rank{i}_{k}": v for i, out in enumerate(outputs)
                             for k, v in out.timings.items()})
        last.timings.update(rpc_s=time.perf_counter() - head.t0, submitted_at=head.submitted_at,
                            collected_at=time.time())
        return head.batch, last

    def head_ready(self) -> bool:
        """Non-blocking: file the replies that arrived; True when the oldest batch has every
        rank's reply, or when its timeout passed (collect() then raises). Raises as collect()
        would (after which nothing is in flight): WorkerLostError when a rank's link went down,
        WorkerError at an error reply. False with nothing in flight."""
        if not self._inflight:
            return False
        head = self._inflight[0]
        # link events: a disconnect loses every batch in flight (as in _wait); a handshake is news
        # only to the monitor, not a reason to block in collect()
        lost = [i for i in range(len(self.socks)) if self._drain_monitor(i)]
        try:
            if lost:
                for i in lost:
                    self._renew(i)
                raise self._lost_error(lost[0], f" while batch {head.batch.batch_id} was in flight")
            for i, sock in enumerate(self.socks):
                while sock.poll(0, zmq.POLLIN):
                    self._file(i, unpack(sock.recv()), head)
        except WorkerError:
            self.abandon()
            raise
        return (all(r is not None for r in head.replies)
                or time.perf_counter() - head.t0 > self.timeout_s)

    def pollables(self) -> list[zmq.Socket]:
        """The sockets whose readiness means news for this executor (replies, link events): a
        caller driving several executors waits on all of theirs at once (zmq.Poller)."""
        return list(self.socks) + [m for m in self.monitors if m is not None]

    def abandon(self) -> None:
        """Forget every batch in flight (their replies, if any come, are dropped by seq) and
        start a new epoch: the next batch sends every request in full. Their KV transfers are
        cancelled at the receivers."""
        for call in self._inflight:
            for send in call.batch.kv_sends if call.batch is not None else ():
                self._announce(send.dst_address, link_auth.kv_cancel_msg(send.req_id))
        self._inflight.clear()
        self.reset()

    def reset(self) -> None:
        """A new epoch for every encoder (the workers then forget what they held)."""
        for enc in self.encoders:
            enc.reset()

    # -- messages to every rank and their replies ---------------------------------------------------
    def _send(self, call: _Call, msgs: list[dict[str, Any]]) -> None:
        """Send msgs[i] to rank i under a new seq; the replies so far are forgotten."""
        call.seq = next(self._seq)
        call.replies = [None] * len(self.socks)
        for i, (sock, msg) in enumerate(zip(self.socks, msgs)):
            try:
                sock.send(pack({**msg, "seq": call.seq}))
            except zmq.Again:   # its queue stayed full for timeout_s: that worker is stuck
                raise WorkerError(f"worker {self.addresses[i]} took no message within {self.timeout_s:.1f}s") from None

    def _call_all(self, msgs: list[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
        """Send msgs[i] to worker i ("info", "ping"), wait for all replies; raise on errors."""
        call = _Call(None)
        self._send(call, msgs)
        self._wait(call, timeout_s)
        return call.replies

    def _wait(self, call: _Call, timeout_s: float) -> None:
        """Poll every rank until `call` has each rank's reply (matched by seq). Replies to other
        batches in flight are filed under them; late replies to a call given up on are dropped.
        Raises WorkerLostError (fresh sockets for the ranks whose link went down), WorkerError at
        an error reply (see _file) or after timeout_s (fresh sockets for the silent ranks)."""
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        for sock, mon in zip(self.socks, self.monitors):
            poller.register(sock, zmq.POLLIN)
            if mon is not None:
                poller.register(mon, zmq.POLLIN)
        while any(r is None for r in call.replies):
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            ready = dict(poller.poll(left_ms))
            # a rank's link went down (process died, or missed heartbeats): every batch in flight
            # is lost with its KV, whether or not that rank answered this call already
            lost = [i for i, mon in enumerate(self.monitors) if mon is not None and mon in ready
                    and self._drain_monitor(i)]
            if lost:
                for i in lost:
                    self._renew(i)   # drop whatever was queued for the dead peer
                what = f" while batch {call.batch.batch_id} was in flight" if call.batch else ""
                raise self._lost_error(lost[0], what)
            if not ready or (time.monotonic() > deadline and not any(s in ready for s in self.socks)):
                # a silent rank may still deliver the late reply: a fresh socket keeps seq matching simple
                silent = [i for i, r in enumerate(call.replies) if r is None]
                why = "; ".join(f"{self.addresses[i]}: {self.handshake_failed[i]}"
                                for i in silent if i in self.handshake_failed)
                for i in silent:
                    self._renew(i)
                what = f" batch {call.batch.batch_id}" if call.batch else ""
                raise WorkerError(f"worker {', '.join(self.addresses[i] for i in silent)} did not "
                                  f"answer{what} within {timeout_s:.1f}s" + (f" ({why})" if why else ""))
            for i, sock in enumerate(self.socks):
                while sock in ready and sock.poll(0, zmq.POLLIN):
                    if self._file(i, unpack(sock.recv()), call):
                        deadline = time.monotonic() + timeout_s   # resent in full: a fresh timeout

    def _file(self, i: int, reply: dict[str, Any], call: _Call) -> bool:
        """File rank i's reply under its call (`call`, or a batch in flight); True if `call` was
        resent in full instead. An error reply raises (see collect)."""
        entry = next((c for c in (call, *self._inflight) if c.seq == reply.get("seq")), None)
        if entry is None:
            return False   # a late answer to a call already given up on
        if not reply.get("ok"):
            kind = reply.get("error")
            if (kind == "unknown_request" and entry is call and call.batch is not None
                    and not call.resent and len(self._inflight) == 1):
                # a worker lost its mirror (restart): start over with every request in full
                call.resent = True
                self.reset()
                self._send(call, [enc.encode(call.batch) for enc in self.encoders])
                return True
            raise self._reply_error(i, reply)
        entry.replies[i] = reply
        return False

    def _reply_error(self, i: int, reply: dict[str, Any]) -> WorkerError:
        """The exception for rank i's error reply."""
        kind, message = reply.get("error"), reply.get("message")
        if kind == "rank_lost":   # a peer of rank i died: the replica's KV is gone
            return WorkerLostError(f"worker {self.addresses[i]}: rank_lost: {message}")
        return WorkerError(f"worker {self.addresses[i]}: {kind}: {message}"
                           + ("; the request state was lost, the next batch is sent in full"
                              if kind == "unknown_request" else ""))

    def _check_instances(self, replies: list[dict[str, Any]]) -> None:
        """Raise WorkerRestartedError if a worker's process changed since the last batch."""
        changed = [self.addresses[i] for i, r in enumerate(replies)
                   if self._instances[i] not in (None, r.get("instance"))]
        self._instances = [r.get("instance") for r in replies]
        if changed:
            raise WorkerRestartedError(f"worker {', '.join(changed)} restarted: its KV cache is lost")

    def _renew(self, i: int) -> None:
        """A fresh socket (and monitor) for worker i: nothing queued for a dead peer is delivered
        to its replacement, and a late reply cannot be mistaken for a new one."""
        _retire(self.socks[i], self.monitors[i])
        self.monitors[i] = None
        self.socks[i] = self._connect(i, self.addresses[i])

    def _lost_error(self, i: int, what: str = "") -> WorkerLostError:
        self._instances[i] = None  # whoever answers next is new: no second "restarted" error
        return WorkerLostError(f"worker {self.addresses[i]} disconnected (process died or missed its "
                               f"heartbeats){what}: its KV cache is lost")

    def _announce(self, kv_address: str, msg: dict[str, Any]) -> None:
        """Tell the KV receiver at kv_address to expect (or forget) a transfer. Never blocks: an
        announcement that cannot be queued is dropped (the transfer is then refused and
        reported failed, and the request recomputed)."""
        if not kv_address.startswith(("tcp://", "ipc://", "inproc://")):
            return   # not a ZeroMQ receiver (a simulated fabric): nothing to tell
        sock = self._announcers.get(kv_address)
        if sock is None:
            sock = link_auth.bound(self.ctx.socket(zmq.DEALER), max_msg_bytes=1 << 16, sndhwm=QUEUED_MSGS,
                                   rcvhwm=1, sndtimeo_ms=0)
            if link_auth.uses_curve(kv_address, self.keys):
                link_auth.connect_curve(sock, self.keys)
            sock.connect(kv_address)
            self._announcers[kv_address] = sock
        try:
            sock.send(pack(msg))
        except zmq.Again:
            log.warning("KV receiver %s: announcement %s for %s dropped (its queue is full)",
                        kv_address, msg["op"], msg["req_id"])

    def close(self) -> None:
        self._finalizer()       # _close_links, once
