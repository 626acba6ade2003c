"""Worker-to-worker KV block transfer over ZeroMQ (prefill/decode disaggregation).

* `KvReceiver` (decode worker): a ROUTER socket on its own thread. A message is two frames,
  [msgpack header, raw K/V bytes] (kvstore.transfer.export_frames' layout); the header names
  the destination block ids and a transfer id. The receiver writes the blocks into the cache
  (kvstore.transfer.import_frames) and acks {"id", "ok"} (or {"ok": False, "error"}). Writing on
  a thread of its own is safe because the scheduler reserved those blocks for this transfer:
  no batch reads or writes them until the handoff completed, which is after this ack.
* `KvSender` (prefill worker): one DEALER per destination; `send()` exports the blocks, sends
  the two frames (the bytes without a copy) and waits for the matching ack up to the KvSend's
  timeout (the lease: after it the send gives up and is reported failed; a late ack is ignored
  by id, and the socket is replaced so nothing queued for a dead peer lingers). The header
  carries `accept_until` (time.time() at 80% of the lease): a receiver that gets the message
  later refuses it, so a send given up on never writes into blocks the scheduler has released
  (clocks of the two machines are assumed within a fraction of the lease; the write itself
  must take less than the remaining 20%).

The whole request's prompt KV goes as one message after the batch's forward pass; per-layer
streaming would overlap the send with the forward pass, which pays only when the transfer is a
visible share of the prefill time (measure kv_transfer_s first).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time

import msgpack
import zmq

from kvstore.transfer import export_frames, import_frames

log = logging.getLogger("sarathi.kv")


class KvTransferError(RuntimeError):
    """A send did not complete: no ack within the timeout, or the receiver refused it."""


class KvReceiver:
    """Receives KV blocks into `cache` at `address`; `self.address` is what senders connect to.
    tcp://host:port binds every interface on that port and advertises the address as given (a
    pod's DNS name, say); tcp://host:0 binds host on any free port; ipc://path binds the path.
    Call close() to stop."""

    def __init__(self, cache, address: str, ctx: zmq.Context | None = None):
        self.cache = cache
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        host_port = address.removeprefix("tcp://")
        if address.startswith("tcp://") and host_port.rpartition(":")[2] not in ("", "0", "*"):
            self.sock.bind(f"tcp://*:{host_port.rpartition(':')[2]}")
            self.address = address
        else:
            self.sock.bind(address)
            self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.num_received = 0          # transfers written
        self.bytes_received = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-receiver", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(100, zmq.POLLIN):
                continue
            frames = self.sock.recv_multipart(copy=False)
            ident, header_frame, data = frames[0], frames[-2], frames[-1]
            try:
                header = msgpack.unpackb(header_frame.bytes, raw=False)
                if time.time() > header.get("accept_until", float("inf")):
                    # the sender gives up soon and the scheduler then hands these blocks to
                    # other requests: a late write would corrupt them
                    raise KvTransferError("arrived after its lease's guard time: refused")
                import_frames(self.cache, header["dst_blocks"], header["kv"], data.buffer)
                reply = {"id": header.get("id"), "ok": True}
                self.num_received += 1
                self.bytes_received += len(data.buffer)
            except Exception as e:  # noqa: BLE001 - any bad message is refused, never fatal
                log.exception("refused a KV transfer")
                reply = {"id": None, "ok": False, "error": f"{type(e).__name__}: {e}"}
                try:
                    reply["id"] = msgpack.unpackb(header_frame.bytes, raw=False).get("id")
                except Exception:  # noqa: BLE001
                    pass
            self.sock.send_multipart([ident.bytes, msgpack.packb(reply, use_bin_type=True)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close(0)


class KvSender:
    """Sends KV blocks of `cache` to receivers; one socket per destination address."""

    def __init__(self, cache, ctx: zmq.Context | None = None):
        self.cache = cache
        self.ctx = ctx or zmq.Context.instance()
        self._socks: dict[str, zmq.Socket] = {}
        self._ids = itertools.count()

    def _sock(self, address: str) -> zmq.Socket:
        sock = self._socks.get(address)
        if sock is None:
            sock = self._socks[address] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        return sock

    def send(self, src_blocks: list[int], dst_address: str, dst_blocks: list[int],
             timeout_s: float) -> tuple[float, int]:
        """Send and wait for the ack: (seconds from the export to the ack, bytes sent). Raises
        KvTransferError (no ack within timeout_s, or refused)."""
        t0 = time.perf_counter()
        kv_header, raw = export_frames(self.cache, src_blocks)
        tid = next(self._ids)
        # the receiver writes only if it starts before 80% of the lease: a transfer the sender
        # gave up on must never land in blocks the scheduler has given to another request since
        accept_until = time.time() + 0.8 * max(0.0, timeout_s - (time.perf_counter() - t0))
        header = msgpack.packb({"id": tid, "dst_blocks": list(dst_blocks), "kv": kv_header,
                                "accept_until": accept_until}, use_bin_type=True)
        sock = self._sock(dst_address)
        deadline = t0 + timeout_s
        try:
            sock.send_multipart([header, raw], copy=False)
            while True:
                left = deadline - time.perf_counter()
                if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    raise KvTransferError(f"timeout: no ack from {dst_address} within {timeout_s:g} s")
                reply = msgpack.unpackb(sock.recv(), raw=False)
                if reply.get("id") != tid:
                    continue   # a late ack of a send given up on
                if not reply.get("ok"):
                    raise KvTransferError(f"refused by {dst_address}: {reply.get('error')}")
                return time.perf_counter() - t0, len(raw)
        except KvTransferError:
            self._socks.pop(dst_address).close(0)   # drop whatever is queued for that peer
            raise

    def close(self) -> None:
        for s in self._socks.values():
            s.close(0)
        self._socks.clear()


class KvLink:
    """A worker's both ends: a KvSender, and a KvReceiver when `address` is given. This is what
    a worker service is handed (worker_svc.service.WorkerServer(kv_link=...)): worker_svc does
    not import kvstore, the process that starts the worker wires them (sarathi)."""

    def __init__(self, cache, address: str | None = None, ctx: zmq.Context | None = None):
        self.sender = KvSender(cache, ctx)
        self.receiver = KvReceiver(cache, address, ctx) if address else None

    @property
    def address(self) -> str | None:
        return self.receiver.address if self.receiver is not None else None

    def send(self, src_blocks: list[int], dst_address: str, dst_blocks: list[int],
             timeout_s: float) -> tuple[float, int]:
        return self.sender.send(src_blocks, dst_address, dst_blocks, timeout_s)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.sender.close()


def make_kv_link(runner, address: str | None) -> KvLink | None:
    """The link of a worker whose model runner has a paged KV cache (`cache`); None otherwise."""
    cache = getattr(runner, "cache", None)
    return KvLink(cache, address) if cache is not None else None
