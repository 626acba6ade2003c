"""The scheduler's side of the worker wire: an executor whose execute() runs on remote workers.

One DEALER socket and one `BatchEncoder` per worker address. Every batch goes to every worker
(all tensor/pipeline ranks get the same plan); the sampled tokens come from the last address
(the rank that samples). Each worker's mirror records only the tokens that worker sampled, so a
rank that does not sample is sent the decode tokens explicitly by the diff logic.

Torch-free: the scheduler never imports torch.
"""
from __future__ import annotations

import itertools
import time
from typing import Any

import zmq

from shared.config import ModelInfo
from shared.messages import Batch, BatchOutput
from shared.wire import BatchEncoder, pack, unpack


class WorkerError(RuntimeError):
    """A worker answered with an error, or did not answer within the timeout."""


class WorkerRestartedError(WorkerError):
    """A worker process was replaced since the last reply: the KV content of every request that
    has computed tokens is lost, so those requests must be recomputed or failed."""


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
        self._model_info = ModelInfo(**replies[0]["model_info"])
        return self._model_info

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

    def close(self) -> None:
        for s in self.socks:
            s.close(0)


class _Resend(Exception):
    """Internal: a worker asked for the batch in full."""
