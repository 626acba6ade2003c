"""The scheduler's side of the worker wire: an executor whose execute() runs on remote workers.

One DEALER socket and one `BatchEncoder` per worker address. Every batch goes to every worker
(all tensor/pipeline ranks get the same plan); the sampled tokens come from the last address
(the rank that samples). Each worker's mirror records only the tokens that worker sampled, so a
rank that does not sample is sent the decode tokens explicitly by the diff logic.

A tensor/pipeline-parallel replica (tp x pp ranks) is addressed by one address per rank, in rank
order, or by rank 0's address alone: its "info" reply names the replica's layout and the other
ranks are found at shared.config.rank_address(). With pp > 1 the scheduler keeps up to pp
micro-batches in flight: `submit(batch)` sends without waiting and `collect()` returns the oldest
batch's output once every rank answered (scheduler_svc.pipeline drives them). An error reply of
any rank fails at once, without waiting for the others (a rank that saw a peer die says so within
seconds; the dead one never answers).

Torch-free: the scheduler never imports torch.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from shared.config import ModelInfo, rank_address
from shared.messages import Batch, BatchOutput
from shared.wire import BatchEncoder, pack, unpack


class WorkerError(RuntimeError):
    """A worker answered with an error, or did not answer within the timeout."""


class WorkerRestartedError(WorkerError):
    """A worker process was replaced since the last reply: the KV content of every request that
    has computed tokens is lost, so those requests must be recomputed or failed."""


class WorkerLayoutError(ValueError):
    """The worker addresses do not match the replica's ranks (a configuration error)."""


@dataclass
class _InFlight:
    """A submitted batch: the seq its messages carry and the replies so far (one per rank)."""

    batch: Batch
    seq: int
    t0: float                      # perf_counter() at submit
    submitted_at: float            # time.time() at submit
    replies: list = field(default_factory=list)


class RemoteExecutor:
    """execute(batch) -> BatchOutput over ZeroMQ.

    addresses: one ZeroMQ address per worker rank, as a list or a comma-separated string.
    timeout_s: seconds to wait for every worker's reply to one message; a slow first batch on a
    CPU is still an answer, a dead worker is not, so keep it generous.
    """

    def __init__(self, addresses: str | list[str], timeout_s: float = 120.0,
                 ctx: zmq.Context | None = None):
        if isinstance(addresses, str):  # "tcp://a:5555,tcp://b:5555" from a flag or env var
            addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
        self.ctx = ctx or zmq.Context.instance()
        self.socks = [self._connect(a) for a in self.addresses]
        self.encoders = [BatchEncoder() for _ in self.addresses]
        self._seq = itertools.count()
        self._model_info: ModelInfo | None = None
        self._instances: list[str | None] = [None] * len(self.addresses)
        self.parallel: dict = {"rank": 0, "world_size": 1, "tp": 1, "pp": 1}
        self._inflight: deque[_InFlight] = deque()
        self._monitors: dict[int, zmq.Socket] = {}   # id(socket) -> its disconnect monitor

    def _connect(self, address: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        return s

    @property
    def model_info(self) -> ModelInfo:
        """The model the workers loaded (asked once; blocks up to timeout_s)."""
        if self._model_info is None:
            self._model_info = self.wait_ready(self.timeout_s)
        return self._model_info

    def wait_ready(self, timeout_s: float) -> ModelInfo:
        """Wait until every worker answers "info"; returns the first worker's ModelInfo."""
        replies = self._call_all([{"op": "info"}] * len(self.socks), timeout_s)
        if self._check_layout(replies):   # rank 0 named more ranks: ask them all
            replies = self._call_all([{"op": "info"}] * len(self.socks), timeout_s)
            self._check_layout(replies)
        self._model_info = ModelInfo(**replies[0]["model_info"])
        return self._model_info

    @property
    def pipeline_depth(self) -> int:
        """Micro-batches to keep in flight: the replica's pipeline stages (known after wait_ready)."""
        return int(self.parallel.get("pp", 1))

    def _check_layout(self, replies: list[dict[str, Any]]) -> bool:
        """Check that address i is rank i of one replica; True if the addresses were expanded
        from rank 0's alone (then ask again)."""
        layout = [r.get("parallel") or {"rank": 0, "world_size": 1, "tp": 1, "pp": 1} for r in replies]
        world = layout[0]["world_size"]
        if all(p["world_size"] == 1 for p in layout):
            return False   # independent one-rank workers, each sent every batch (as before)
        if world > 1 and len(self.addresses) == 1:
            for r in range(1, world):
                self.addresses.append(rank_address(self.addresses[0], r))
                self.socks.append(self._connect(self.addresses[-1]))
                self.encoders.append(BatchEncoder())
                self._instances.append(None)
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

    def execute(self, batch: Batch) -> BatchOutput:
        """Run one iteration. Raises WorkerError; after an error every encoder starts a new
        epoch, so the next batch re-sends all requests in full."""
        t0 = time.perf_counter()
        try:
            replies = self._execute_once(batch)
            self._check_instances(replies)
        except WorkerError:
            self.reset()
            raise
        outputs = [BatchOutput.from_wire(r) for r in replies]
        for enc, out in zip(self.encoders, outputs):
            enc.on_output(out)
        last = outputs[-1]
        last.timings["rpc_s"] = time.perf_counter() - t0
        return last

    def _execute_once(self, batch: Batch) -> list[dict[str, Any]]:
        msgs = [enc.encode(batch) for enc in self.encoders]
        try:
            return self._call_all(msgs, self.timeout_s)
        except _Resend:
            # a worker lost its mirror (restart): start over with every request in full
            self.reset()
            return self._call_all([enc.encode(batch) for enc in self.encoders], self.timeout_s)

    def reset(self) -> None:
        for enc in self.encoders:
            enc.reset()

    def _call_all(self, msgs: list[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
        """Send msgs[i] to worker i, wait for all replies (matched by seq); raise on errors."""
        seq = next(self._seq)
        for sock, msg in zip(self.socks, msgs):
            sock.send(pack({**msg, "seq": seq}))
        replies = [self._recv(i, seq, timeout_s) for i in range(len(self.socks))]
        for i, r in enumerate(replies):
            if not r.get("ok"):
                if r.get("error") == "unknown_request":
                    raise _Resend()
                raise WorkerError(f"worker {self.addresses[i]}: {r.get('error')}: {r.get('message')}")
        return replies

    def _check_instances(self, replies: list[dict[str, Any]]) -> None:
        """Raise WorkerRestartedError if a worker's process changed since the last batch."""
        changed = [self.addresses[i] for i, r in enumerate(replies)
                   if self._instances[i] not in (None, r.get("instance"))]
        self._instances = [r.get("instance") for r in replies]
        if changed:
            raise WorkerRestartedError(f"worker {', '.join(changed)} restarted: its KV cache is lost")

    def _recv(self, i: int, seq: int, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        sock = self.socks[i]
        while True:
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if not sock.poll(left_ms, zmq.POLLIN):
                # the socket may still deliver the late reply: a fresh socket keeps seq matching simple
                sock.close(0)
                self.socks[i] = self._connect(self.addresses[i])
                raise WorkerError(f"worker {self.addresses[i]} did not answer within {timeout_s:.1f}s")
            reply = unpack(sock.recv())
            if reply.get("seq") == seq:
                return reply  # anything else is a late answer to a request we gave up on

    # -- micro-batches in flight (pipeline parallelism) -------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

    def submit(self, batch: Batch) -> None:
        """Send `batch` to every rank and return at once; collect() returns outputs in submit
        order. The caller keeps the scheduler's invariant: a request is in at most one batch in
        flight (so each encoder's mirror sees a request's tokens before its next chunk)."""
        msgs = [enc.encode(batch) for enc in self.encoders]
        seq = next(self._seq)
        for sock, msg in zip(self.socks, msgs):
            sock.send(pack({**msg, "seq": seq}))
        self._inflight.append(_InFlight(batch, seq, time.perf_counter(), time.time(),
                                        [None] * len(self.socks)))

    def collect(self, timeout_s: float | None = None) -> tuple[Batch, BatchOutput]:
        """(batch, output) of the oldest submitted batch, once every rank answered. The output is
        the last rank's (it samples), with each rank's timings added as rank<i>_<name>
        (start/end: time.time() seconds) and submitted_at / collected_at (time.time()).
        Raises WorkerError at the first error reply or after timeout_s without all replies;
        every batch in flight is then lost and the next batch starts a new epoch."""
        if not self._inflight:
            raise RuntimeError("collect() with no batch in flight")
        head = self._inflight[0]
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        poller = zmq.Poller()
        monitors = [self._monitor(i) for i in range(len(self.socks))]
        for sock, mon in zip(self.socks, monitors):
            poller.register(sock, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
        while any(r is None for r in head.replies):
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            ready = dict(poller.poll(left_ms))
            for i, mon in enumerate(monitors):
                # a connection to a rank closed (its process died): fail now, not at the timeout
                if mon in ready and _drain_disconnects(mon) and head.replies[i] is None:
                    self._abandon([self.addresses[i]])
                    raise WorkerError(f"worker rank {self.addresses[i]} disconnected while batch "
                                      f"{head.batch.batch_id} was in flight (process died?)")
            if not ready:
                silent = [self.addresses[i] for i, r in enumerate(head.replies) if r is None]
                self._abandon(silent)
                raise WorkerError(f"worker rank(s) {', '.join(silent)} did not answer batch "
                                  f"{head.batch.batch_id} within {self.timeout_s:.1f}s")
            for i, sock in enumerate(self.socks):
                while sock in ready and sock.poll(0, zmq.POLLIN):
                    self._route(i, unpack(sock.recv()))
        replies = head.replies
        try:
            self._check_instances(replies)
        except WorkerError:
            self._abandon([])
            raise
        self._inflight.popleft()
        outputs = [BatchOutput.from_wire(r) for r in replies]
        for enc, out in zip(self.encoders, outputs):
            enc.on_output(out)
        last = outputs[-1]
        per_rank = {f"rank{i}_{k}": v for i, out in enumerate(outputs) for k, v in out.timings.items()}
        last.timings.update(per_rank)
        last.timings.update(rpc_s=time.perf_counter() - head.t0, submitted_at=head.submitted_at,
                            collected_at=time.time())
        return head.batch, last

    def _route(self, i: int, reply: dict[str, Any]) -> None:
        """File rank i's reply under its batch; an error reply fails everything in flight."""
        entry = next((f for f in self._inflight if f.seq == reply.get("seq")), None)
        if entry is None:
            return  # a late answer to a batch already given up on
        if not reply.get("ok"):
            self._abandon([])
            kind = reply.get("error")
            raise WorkerError(f"worker {self.addresses[i]}: {kind}: {reply.get('message')}"
                              + ("; the request state was lost, the next batch is sent in full"
                                 if kind == "unknown_request" else ""))
        entry.replies[i] = reply

    def _abandon(self, silent: list[str]) -> None:
        """Forget every batch in flight; fresh sockets for silent ranks (so a message queued for
        a dead peer is not delivered to its replacement), new epoch for all."""
        self._inflight.clear()
        for i, a in enumerate(self.addresses):
            if a in silent:
                mon = self._monitors.pop(id(self.socks[i]), None)
                if mon is not None:
                    self.socks[i].disable_monitor()
                    mon.close(0)
                self.socks[i].close(0)
                self.socks[i] = self._connect(a)
        self.reset()

    def _monitor(self, i: int) -> zmq.Socket:
        """A socket receiving rank i's EVENT_DISCONNECTED events (created on first use)."""
        sock = self.socks[i]
        mon = self._monitors.get(id(sock))
        if mon is None:
            mon = self._monitors[id(sock)] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        return mon

    def close(self) -> None:
        for mon in self._monitors.values():
            mon.close(0)
        for s in self.socks:
            s.close(0)


def _drain_disconnects(mon: zmq.Socket) -> bool:
    """Read every pending monitor event; True if one was a disconnect."""
    from zmq.utils.monitor import recv_monitor_message

    seen = False
    while mon.poll(0, zmq.POLLIN):
        seen |= recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
    return seen


class _Resend(Exception):
    """Internal: a worker asked for the batch in full."""
