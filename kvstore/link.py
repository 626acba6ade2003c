"""Worker-to-worker KV block transfer over ZeroMQ (prefill/decode disaggregation).

* `KvReceiver` (decode worker): a ROUTER socket on its own thread. It writes only transfers the
  scheduler announced: an *expected-transfer table* holds, per request id, the destination block
  ids the scheduler reserved and a lease deadline. Two kinds of messages reach it:
  - an announcement from the scheduler, one msgpack frame (shared.link_auth.kv_expect_msg /
    kv_cancel_msg; no reply): expect one transfer for this request into exactly these blocks
    within lease_s seconds, or forget it;
  - a transfer from a worker, two frames [msgpack header, raw K/V bytes]
    (kvstore.transfer.export_frames' layout); the header names the request id, the destination
    block ids, a transfer id and `accept_until` (required). It is written (import_frames) only
    when its request's entry names the same blocks, before both deadlines; the entry is then
    used up, so a replay writes nothing. It is acked {"id", "ok"} (or {"ok": False, "error"}).
  With link keys (tcp://), the socket is a CURVE server: only the schedulers' keys may announce
  and only the workers' keys may send blocks (the client key of each message, see
  shared.link_auth.peer_key); anyone else fails the handshake. A forged, unannounced, replayed
  or late transfer writes nothing. Writing on a thread of its own is safe because the scheduler
  reserved those blocks for this transfer: no batch reads or writes them until the handoff
  completed, which is after this ack.
* `KvSender` (prefill worker): one DEALER per destination; `send()` exports the blocks, sends
  the two frames (the bytes without a copy) and waits for the matching ack up to the KvSend's
  timeout (the lease: after it the send gives up and is reported failed; a late ack is ignored
  by id, and the socket is replaced so nothing queued for a dead peer lingers). The header
  carries `accept_until` (time.time() at 80% of the lease): a receiver that gets the message
  later refuses it, so a send given up on never writes into blocks the scheduler has released
  (clocks of the two machines are assumed within a fraction of the lease; the write itself
  must take less than the remaining 20%).

The announcement travels scheduler -> receiver, the blocks prefill worker -> receiver: two
connections, so their order is not guaranteed, but the announcement leaves before the prefill
batch is even sent and the blocks only after its forward pass. A transfer that still arrives
first is refused and reported failed (the request is recomputed); it is never written.

Every socket is bounded (shared.link_auth.bound): a receiver takes no message larger than its
whole cache, a sender queues at most a couple of messages per destination and gives up a send
that cannot be queued within the lease.

The whole request's prompt KV goes as one message after the batch's forward pass; per-layer
streaming would overlap the send with the forward pass, which pays only when the transfer is a
visible share of the prefill time (measure kv_transfer_s first).
"""
from __future__ import annotations

import ipaddress
import itertools
import logging
import threading
import time
from dataclasses import dataclass

import msgpack
import zmq

from kvstore.transfer import export_frames, import_frames
from shared import link_auth
from shared.link_auth import MAX_LEASE_S, LinkKeys

log = logging.getLogger("sarathi.kv")

MAX_EXPECTED = 4096        # announced transfers held at once; the oldest is dropped beyond it
CONTROL_MAX_MSG_BYTES = 1 << 20   # an ack, or an announcement (a request's block ids)


class KvTransferError(RuntimeError):
    """A send did not complete: no ack within the timeout, or the receiver refused it."""


@dataclass(frozen=True)
class Expected:
    """One announced transfer: the receiver's block ids, in order, and until when (monotonic s)."""

    blocks: tuple[int, ...]
    deadline: float


def _cache_bytes(cache) -> int:
    """Bytes of the whole cache, K and V of every layer: no transfer can be larger."""
    return sum(t.numel() * t.element_size() for t in list(cache.k) + list(cache.v))


class KvReceiver:
    """Receives KV blocks into `cache` at `address`; `self.address` is what senders connect to.
    tcp://NAME:port (a DNS name) binds every interface on that port and advertises the address
    as given (a pod's DNS name, say); tcp://IP:port binds that IP; tcp://host:0 binds host on
    any free port; ipc://path binds the path. keys: "env" (shared.link_auth.process_keys("worker")),
    or LinkKeys, or None (plain: loopback and ipc only, see shared.link_auth.check_bind).
    Call close() to stop."""

    def __init__(self, cache, address: str, ctx: zmq.Context | None = None,
                 keys: LinkKeys | None | str = "env"):
        self.cache = cache
        self.ctx = ctx or zmq.Context.instance()
        self.keys = link_auth.process_keys("worker") if keys == "env" else keys
        host = link_auth.tcp_host(address)
        port = address.rpartition(":")[2] if host is not None else ""
        # a name (tcp://decode-0:5600): others reach it by that name, so every interface listens
        advertised = host is not None and port not in ("", "0", "*") and not _is_ip(host)
        bind = f"tcp://{'127.0.0.1' if host == 'localhost' else '*'}:{port}" if advertised else address
        link_auth.check_bind(bind, self.keys, "the KV receiver")
        self.sock = link_auth.bound(self.ctx.socket(zmq.ROUTER),
                                    max_msg_bytes=_cache_bytes(cache) + CONTROL_MAX_MSG_BYTES,
                                    sndhwm=64, rcvhwm=4)
        self._zap_domain = None
        if link_auth.uses_curve(address, self.keys):
            self._zap_domain = link_auth.serve_curve(self.sock, self.keys,
                                                     self.keys.schedulers | self.keys.workers, self.ctx)
        self.sock.bind(bind)
        self.address = address if advertised else self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.num_received = 0          # transfers written
        self.bytes_received = 0
        self.num_refused = 0           # transfers refused (nothing written)
        self.expected: dict[str, Expected] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-receiver", daemon=True)
        self._thread.start()

    # -- the expected-transfer table ---------------------------------------------------------------
    def expect(self, req_id: str, blocks: list[int], lease_s: float) -> None:
        """Accept one transfer for req_id into exactly `blocks` within lease_s seconds from now."""
        if not 0 < lease_s <= MAX_LEASE_S:
            raise ValueError(f"a lease must be in (0, {MAX_LEASE_S:g}] seconds, got {lease_s!r}")
        with self._lock:
            now = time.monotonic()
            for rid in [r for r, e in self.expected.items() if e.deadline < now]:
                del self.expected[rid]
            self.expected.pop(req_id, None)
            while len(self.expected) >= MAX_EXPECTED:
                del self.expected[next(iter(self.expected))]
            self.expected[req_id] = Expected(tuple(blocks), now + lease_s)

    def cancel(self, req_id: str) -> None:
        with self._lock:
            self.expected.pop(req_id, None)

    def _claim(self, req_id, blocks) -> None:
        """Use up req_id's announcement if it names these blocks and is within its lease; raise
        KvTransferError otherwise (nothing is written then)."""
        with self._lock:
            exp = self.expected.get(req_id) if isinstance(req_id, str) else None
            if exp is None:
                raise KvTransferError(f"no transfer for request {req_id!r} was announced: refused")
            if exp.deadline < time.monotonic():
                del self.expected[req_id]
                raise KvTransferError(f"the transfer for request {req_id!r} arrived after its lease: refused")
            if not isinstance(blocks, list) or tuple(blocks) != exp.blocks:
                raise KvTransferError(f"blocks {blocks!r} are not the ones announced for {req_id!r}: refused")
            del self.expected[req_id]

    # -- the socket --------------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(100, zmq.POLLIN):
                continue
            frames = self.sock.recv_multipart(copy=False)
            peer = link_auth.peer_key(frames[-1]) if self._zap_domain is not None else None
            if len(frames) == 2:
                self._control(frames[1].bytes, peer)
                continue
            reply = self._transfer(frames[-2], frames[-1], peer)
            try:
                self.sock.send_multipart([frames[0].bytes, msgpack.packb(reply, use_bin_type=True)],
                                         flags=zmq.NOBLOCK)
            except zmq.ZMQError:   # the sender's queue is full or it is gone: nothing to tell
                pass

    def _control(self, payload: bytes, peer: bytes | None) -> None:
        """An announcement: from a scheduler's key (with CURVE), else ignored."""
        try:
            if self._zap_domain is not None and peer not in self.keys.schedulers:
                raise KvTransferError("an announcement from a key that is not a scheduler's")
            msg = msgpack.unpackb(payload, raw=False)
            op, rid = msg.get("op"), msg.get("req_id")
            if not isinstance(rid, str):
                raise KvTransferError("an announcement without a request id")
            if op == "expect":
                blocks, lease = msg.get("blocks"), msg.get("lease_s")
                if (not isinstance(blocks, list) or not all(type(b) is int for b in blocks)
                        or not isinstance(lease, (int, float)) or isinstance(lease, bool)):
                    raise KvTransferError("a malformed announcement")
                self.expect(rid, blocks, float(lease))
            elif op == "cancel":
                self.cancel(rid)
            else:
                raise KvTransferError(f"unknown announcement op {op!r}")
        except Exception as e:  # noqa: BLE001 - a bad announcement is dropped, never fatal
            log.warning("ignored a KV announcement: %s", e)

    def _transfer(self, header_frame, data, peer: bytes | None) -> dict:
        """Write one transfer if it was announced (see the module doc); the ack."""
        tid = None
        try:
            if self._zap_domain is not None and peer not in self.keys.workers:
                raise KvTransferError("KV blocks from a key that is not a worker's: refused")
            header = msgpack.unpackb(header_frame.bytes, raw=False)
            if not isinstance(header, dict):
                raise KvTransferError("a malformed transfer header")
            tid = header.get("id")
            accept_until = header.get("accept_until")
            if not isinstance(accept_until, (int, float)) or isinstance(accept_until, bool):
                raise KvTransferError("a transfer without accept_until: refused")
            if time.time() > accept_until:
                # the sender gives up soon and the scheduler then hands these blocks to
                # other requests: a late write would corrupt them
                raise KvTransferError("arrived after its lease's guard time: refused")
            self._claim(header.get("req_id"), header.get("dst_blocks"))
            import_frames(self.cache, header["dst_blocks"], header["kv"], data.buffer)
            self.num_received += 1
            self.bytes_received += len(data.buffer)
            return {"id": tid, "ok": True}
        except Exception as e:  # noqa: BLE001 - any bad message is refused, never fatal
            log.warning("refused a KV transfer: %s", e)
            self.num_refused += 1
            return {"id": tid if isinstance(tid, int) else None, "ok": False, "error": f"{type(e).__name__}: {e}"}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close(0)
        link_auth.release_domain(self.ctx, self._zap_domain)


def _is_ip(host: str) -> bool:
    """An IP literal or a wildcard: bound as given (a name is bound on every interface)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return host == "*"


class KvSender:
    """Sends KV blocks of `cache` to receivers; one socket per destination address. keys: as
    KvReceiver's (a worker's keys: on tcp:// it is a CURVE client of the receiving worker)."""

    def __init__(self, cache, ctx: zmq.Context | None = None, keys: LinkKeys | None | str = "env"):
        self.cache = cache
        self.ctx = ctx or zmq.Context.instance()
        self.keys = link_auth.process_keys("worker") if keys == "env" else keys
        self._socks: dict[str, zmq.Socket] = {}
        self._ids = itertools.count()

    def _sock(self, address: str) -> zmq.Socket:
        sock = self._socks.get(address)
        if sock is None:
            # at most two messages queued for a peer: a stuck receiver cannot pile up exports
            sock = self._socks[address] = link_auth.bound(
                self.ctx.socket(zmq.DEALER), max_msg_bytes=CONTROL_MAX_MSG_BYTES, sndhwm=2, rcvhwm=64)
            if link_auth.uses_curve(address, self.keys):
                link_auth.connect_curve(sock, self.keys)
            sock.connect(address)
        return sock

    def send(self, src_blocks: list[int], dst_address: str, dst_blocks: list[int],
             timeout_s: float, req_id: str = "") -> tuple[float, int]:
        """Send req_id's blocks and wait for the ack: (seconds from the export to the ack, bytes
        sent). The receiver writes them only if the scheduler announced this transfer. Raises
        KvTransferError (not queued or no ack within timeout_s, or refused)."""
        t0 = time.perf_counter()
        kv_header, raw = export_frames(self.cache, src_blocks)
        tid = next(self._ids)
        # the receiver writes only if it starts before 80% of the lease: a transfer the sender
        # gave up on must never land in blocks the scheduler has given to another request since
        accept_until = time.time() + 0.8 * max(0.0, timeout_s - (time.perf_counter() - t0))
        header = msgpack.packb({"id": tid, "req_id": req_id, "dst_blocks": list(dst_blocks), "kv": kv_header,
                                "accept_until": accept_until}, use_bin_type=True)
        sock = self._sock(dst_address)
        deadline = t0 + timeout_s
        try:
            sock.setsockopt(zmq.SNDTIMEO, max(1, int((deadline - time.perf_counter()) * 1000)))
            try:
                sock.send_multipart([header, raw], copy=False)
            except zmq.Again:
                raise KvTransferError(f"timeout: {dst_address} took no message within {timeout_s:g} s") from None
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

    def __init__(self, cache, address: str | None = None, ctx: zmq.Context | None = None,
                 keys: LinkKeys | None | str = "env"):
        self.sender = KvSender(cache, ctx, keys)
        self.receiver = KvReceiver(cache, address, ctx, keys) if address else None

    @property
    def address(self) -> str | None:
        return self.receiver.address if self.receiver is not None else None

    def send(self, src_blocks: list[int], dst_address: str, dst_blocks: list[int],
             timeout_s: float, req_id: str = "") -> tuple[float, int]:
        return self.sender.send(src_blocks, dst_address, dst_blocks, timeout_s, req_id)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.sender.close()


def make_kv_link(runner, address: str | None) -> KvLink | None:
    """The link of a worker whose model runner has a paged KV cache (`cache`); None otherwise."""
    cache = getattr(runner, "cache", None)
    return KvLink(cache, address) if cache is not None else None
