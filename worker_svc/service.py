"""The worker service: a ZeroMQ ROUTER socket in front of one model runner (one device).

Requests are msgpack dicts with an "op" and a client-chosen "seq" number that the reply echoes
(so a client can drop a late reply to a request it already gave up on). Every reply also carries
"instance", an id of this server process: a change tells the client that the worker restarted
and its KV cache (the content of every block) is gone.

* {"op": "ping"} -> {"ok": True}
* {"op": "info"} -> {"ok": True, "model_info": {...ModelInfo fields...},
  "parallel": {"rank", "world_size", "tp", "pp"} (this rank's place in a TP x PP replica),
  "role": mixed | prefill | decode, "kv_address": where it receives KV blocks, or None}
* a batch may carry "kv_sends" (shared.messages.KvSend): after its forward pass the worker sends
  those blocks to the named workers (kvstore.link) and the reply reports "kv_sent" / "kv_failed"
* {"op": "batch", "epoch", "batch_id", "seqs", "freed"} (see shared.wire) ->
  {"ok": True, "batch_id", "sampled": {req_id: token_id}, "timings": {name: seconds},
  "logprobs": {req_id: [logprob, [top ids], [top logprobs]]} (only when a request asked)}

Any failure is a reply, never silence: {"ok": False, "error": kind, "message": text}, with kind
"unknown_request" (a diff for a request this worker holds no state for: resend in full),
"bad_request" (malformed message: checked whole before anything changes, see
worker_svc.wire_check), "execute_failed" (the model runner raised; the worker forgets all
per-request state, so the client must start a new epoch) or "unknown_op". A model runner error
marked `fatal` (another rank of the replica is lost: worker_svc.parallel.RankLostError) is
replied as "rank_lost", then the server stops: the process group cannot be repaired, the
launcher restarts the replica.

The socket is bounded (shared.link_auth.bound: largest message, queues) and, on tcp:// with
link keys configured, a CURVE server that accepts only the schedulers' keys: a client without an
authorized key never completes the handshake, so it gets no answer at all. Without keys it may
bind loopback only (shared.link_auth.check_bind).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Any, Protocol

import zmq

from shared import link_auth
from shared.config import WorkerServiceConfig, rank_address, single_rank_layout
from shared.link_auth import LinkKeys
from shared.messages import Batch, BatchOutput
from shared.wire import BatchDecoder, UnknownRequestError, error_reply, output_reply, pack, unpack
from worker_svc.wire_check import WireCheckError, WireLimits, check_batch_message

log = logging.getLogger("sarathi.worker")

# The largest batch message a worker takes (bytes): a new epoch resends every running request
# in full, prior tokens included, so this is sized for hundreds of long contexts; a larger
# message drops the connection instead of being buffered.
MAX_BATCH_MSG_BYTES = 256 << 20
QUEUED_MSGS = 64    # per peer and direction: the scheduler keeps pp batches (and a ping) in flight


@dataclasses.dataclass(eq=False)
class _Started:
    """A batch message decoded and launched: run is the runner's launch() handle (launched) or
    execute()'s output; seq: the message's sequence number; t0, t1: perf_counter() at the
    message and after decoding it."""

    batch: Batch
    run: Any
    launched: bool
    t0: float
    t1: float
    seq: int | None = None

    def ready(self) -> bool:
        """True when answering it would not wait for the device."""
        return not self.launched or self.run.ready()

    def block(self) -> None:
        if self.launched:
            self.run.block()


class _Waker:
    """Tells the server loop when a held batch's tokens are back: one thread blocks on each
    watched batch (a CUDA event's wait releases the GIL) and then sends an empty message on an
    inproc PAIR socket the loop polls beside its ROUTER. One wake-up per watched batch."""

    def __init__(self, ctx: zmq.Context):
        import queue
        addr = f"inproc://worker-waker-{uuid.uuid4().hex}"
        self.rx = ctx.socket(zmq.PAIR)
        self.rx.bind(addr)
        self._tx = ctx.socket(zmq.PAIR)
        self._tx.connect(addr)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="worker-waker", daemon=True)
        self._thread.start()

    def watch(self, started: _Started) -> None:
        self._queue.put(started)

    def _run(self) -> None:
        while (started := self._queue.get()) is not None:
            try:
                started.block()
            except Exception:   # noqa: BLE001 - the loop's own finish() reports the error
                pass
            self._tx.send(b"")
        self._tx.close(0)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)
        self.rx.close(0)


class ServedRunner(Protocol):
    """What a WorkerServer serves: the service's view of a ModelRunner
    (worker_svc.model_runner), or of a stand-in that answers the same calls (tests' simulated
    worker). parallel_info (optional): this rank's place in a replica, for the "info" reply."""

    model_info: Any

    def execute(self, batch: Batch) -> BatchOutput: ...

    def free(self, req_ids: list[str]) -> None: ...


class KvLinkLike(Protocol):
    """Worker-to-worker KV blocks (kvstore.link.KvLink): sends, and receives at `address`."""

    address: str | None

    def send(self, src_blocks: list[int], dst_address: str, dst_blocks: list[int],
             timeout_s: float, req_id: str = "") -> tuple[float, int]: ...

    def close(self) -> None: ...


class WorkerServer:
    """Serves one model runner on `address` (tcp://, ipc:// or inproc://). Single-threaded:
    batches are executed one at a time, in arrival order (the wire mirror relies on that order).

    keys: the worker's link keys ("env": shared.link_auth.process_keys("worker"), None: plain).
    Raises shared.link_auth.LinkSecurityError for a plain socket on a network address."""

    def __init__(self, runner: ServedRunner, address: str, ctx: zmq.Context | None = None,
                 role: str = "mixed", kv_link: KvLinkLike | None = None,
                 keys: LinkKeys | None | str = "env"):
        self.runner = runner
        self.role = role
        self.decoder = BatchDecoder()
        self.limits = WireLimits.of(runner.model_info)
        # names this process's KV cache: a client that sees it change knows the KV is gone
        self.instance = uuid.uuid4().hex
        self.ctx = ctx or zmq.Context.instance()
        self.keys = link_auth.process_keys("worker") if keys == "env" else keys
        link_auth.check_bind(address, self.keys, "the worker")
        self.sock = link_auth.bound(self.ctx.socket(zmq.ROUTER), max_msg_bytes=MAX_BATCH_MSG_BYTES,
                                    sndhwm=QUEUED_MSGS, rcvhwm=QUEUED_MSGS)
        self._zap_domain = (link_auth.serve_curve(self.sock, self.keys, self.keys.schedulers, self.ctx)
                            if link_auth.uses_curve(address, self.keys) else None)
        self.sock.bind(address)
        # the address actually bound (resolves tcp://*:0 to a real port)
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.fatal: str | None = None   # set when a fatal runner error stopped the server
        self._waker: _Waker | None = None   # made when a batch is first held (a GPU runner)
        # disaggregation: KV blocks in (the link's receiver thread) and out (after a forward pass)
        self.kv_link = kv_link

    def serve_forever(self, stop: threading.Event | None = None, poll_ms: int = 100) -> None:
        """Answer requests until `stop` is set (checked every poll_ms milliseconds).

        A batch from a scheduler that plans ahead (Batch.ahead: async scheduling) whose tokens
        stay on the device a while (ModelRunner.launch: the CUDA backend) is held, not waited
        for: if the next message arrives while it runs, that batch is launched first, queued
        behind it on the device, and only then is the held one answered; otherwise it is
        answered as soon as its tokens are back (a _Waker thread waits for them). So the device
        finds its next batch queued when it finishes one, and this process prepares it while the
        device works. Replies go out in arrival order."""
        stop = stop or threading.Event()
        held = None   # (frames, _Started): launched, not answered yet
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self._waker is not None:
            poller.register(self._waker.rx, zmq.POLLIN)
        while not stop.is_set() and self.fatal is None:
            ready = dict(poller.poll(poll_ms))
            if self._waker is not None and self._waker.rx in ready:
                self._waker.rx.recv()
                if held is not None and held[1].ready():
                    self._reply(held[0], self._end(held[1]))
                    held = None
            if self.sock not in ready:
                continue
            # frames: [client identity, (envelope...), payload]; reply on the same envelope
            frames = self.sock.recv_multipart()
            started = self.begin_bytes(frames[-1])
            if held is not None:
                self._reply(held[0], self._end(held[1]))
                held = None
            if isinstance(started, dict):
                self._reply(frames, started)
            elif started.ready():
                self._reply(frames, self._end(started))
            else:
                if self._waker is None:
                    self._waker = _Waker(self.ctx)
                    poller.register(self._waker.rx, zmq.POLLIN)
                self._waker.watch(started)
                held = (frames, started)
        if held is not None:
            self._reply(held[0], self._end(held[1]))

    def _reply(self, frames: list[bytes], reply: dict[str, Any]) -> None:
        # a ROUTER drops a reply to a peer whose queue is full: never blocks
        self.sock.send_multipart(frames[:-1] + [pack(reply)])

    def close(self) -> None:
        if self.kv_link is not None:
            self.kv_link.close()
        if self._waker is not None:
            self._waker.close()
        self.sock.close(0)
        link_auth.release_domain(self.ctx, self._zap_domain)

    @property
    def kv_address(self) -> str | None:
        return self.kv_link.address if self.kv_link is not None else None

    def handle_bytes(self, payload: bytes) -> dict[str, Any]:
        """The reply to one message; never raises (a worker outlives any message)."""
        started = self.begin_bytes(payload)
        return started if isinstance(started, dict) else self._end(started)

    def begin_bytes(self, payload: bytes) -> "dict[str, Any] | _Started":
        """The reply to one message, or for a batch its start (answered by _end); never raises."""
        try:
            msg = unpack(payload)
            seq = msg.get("seq")
        except Exception as e:  # not msgpack, or not a map
            return error_reply("bad_request", f"cannot decode message: {e!r}")
        seq = seq if isinstance(seq, int) else None
        try:
            reply = self.handle(msg)
        except Exception as e:  # noqa: BLE001 - a bug's message is an error reply, not a dead worker
            log.exception("message %r failed", msg.get("op"))
            reply = error_reply("bad_request", f"{type(e).__name__}: {e}")
        if isinstance(reply, _Started):
            reply.seq = seq
            return reply
        reply.update(seq=seq, instance=self.instance)
        return reply

    def _end(self, st: "_Started") -> dict[str, Any]:
        try:
            reply = self._batch_end(st)
        except Exception as e:  # noqa: BLE001 - as in begin_bytes
            log.exception("batch %s failed", st.batch.batch_id)
            reply = error_reply("bad_request", f"{type(e).__name__}: {e}")
        reply.update(seq=st.seq, instance=self.instance)
        return reply

    def handle(self, msg: dict[str, Any]) -> "dict[str, Any] | _Started":
        """The reply to one decoded message; for a batch, its start (begin_bytes)."""
        op = msg.get("op")
        if op == "ping":
            return {"ok": True}
        if op == "info":
            return {"ok": True, "model_info": dataclasses.asdict(self.runner.model_info),
                    "parallel": getattr(self.runner, "parallel_info", None) or single_rank_layout(),
                    "role": self.role, "kv_address": self.kv_address}
        if op == "batch":
            return self._batch_begin(msg)
        return error_reply("unknown_op", f"unknown op {op!r}; expected ping, info or batch")

    def _batch_begin(self, msg: dict[str, Any]) -> "dict[str, Any] | _Started":
        """Check, decode and launch a batch: an error reply, or the batch started (answered by
        _batch_end once its tokens are back)."""
        t0 = time.perf_counter()
        try:   # whole message first: a malformed one changes nothing
            mirror = self.decoder.states if msg.get("epoch") == self.decoder.epoch else {}
            check_batch_message(msg, mirror, self.limits)
        except WireCheckError as e:
            log.warning("refused a malformed batch message: %s", e)
            return error_reply("bad_request", f"malformed batch message: {e}")
        try:
            dropped = self.decoder.new_epoch(msg["epoch"])
            if dropped:
                self.runner.free(dropped)
            batch = self.decoder.decode(msg)
        except UnknownRequestError as e:
            return error_reply("unknown_request", f"no state for request {e.args[0]!r}; send it in full")
        except (KeyError, TypeError, ValueError) as e:
            return error_reply("bad_request", f"malformed batch message: {e!r}")
        t1 = time.perf_counter()
        # launched and held only for a scheduler that plans ahead: for one that waits for each
        # reply, holding would only add the hand-off from the waker to the reply
        launch = getattr(self.runner, "launch", None) if batch.ahead else None
        try:
            run = launch(batch) if launch is not None else self.runner.execute(batch)
        except Exception as e:
            return self._failed(batch, e)
        return _Started(batch, run, launch is not None, t0, t1)

    def _batch_end(self, st: "_Started") -> dict[str, Any]:
        """The reply to a started batch (waits for its tokens)."""
        try:
            output = self.runner.finish(st.run) if st.launched else st.run
        except Exception as e:
            return self._failed(st.batch, e)
        self.decoder.on_output(output)
        if st.batch.kv_sends:
            self._send_kv(st.batch, output)
        timings = dict(output.timings)
        timings.update(decode_s=st.t1 - st.t0, worker_total_s=time.perf_counter() - st.t0)
        return output_reply(BatchOutput(output.batch_id, dict(output.sampled), timings, output.logprobs,
                                        output.kv_sent, output.kv_failed, output.accepted,
                                        output.accepted_logprobs))

    def _failed(self, batch: Batch, e: Exception) -> dict[str, Any]:
        if getattr(e, "fatal", False):
            log.error("batch %s: %s; stopping this rank", batch.batch_id, e)
            self.fatal = str(e)
            return error_reply("rank_lost", str(e))
        log.exception("executor failed on batch %s", batch.batch_id, exc_info=e)
        self._forget_all()
        return error_reply("execute_failed", f"{type(e).__name__}: {e}")

    def _send_kv(self, batch: Batch, output: BatchOutput) -> None:
        """After the forward pass: send each KvSend's blocks to its receiver, synchronously (the
        transfer time is a separate term of this batch: timings["kv_transfer_s"])."""
        t0 = time.perf_counter()
        for send in batch.kv_sends:
            if self.kv_link is None:
                output.kv_failed[send.req_id] = "this worker has no KV link to send with"
                continue
            try:
                seconds, nbytes = self.kv_link.send(send.src_blocks, send.dst_address,
                                                      send.dst_blocks, send.timeout_s, req_id=send.req_id)
                output.kv_sent[send.req_id] = {"kv_transfer_s": seconds, "kv_bytes": nbytes}
            except Exception as e:  # noqa: BLE001 - a failed send is reported, never fatal
                log.warning("KV send of %s to %s failed: %s", send.req_id, send.dst_address, e)
                output.kv_failed[send.req_id] = str(e)
        output.timings["kv_transfer_s"] = time.perf_counter() - t0

    def _forget_all(self) -> None:
        """After a failed execute the runner's per-request state is unknown: drop it all and
        make the client start a new epoch (its next batch sends every request in full)."""
        ids = self.decoder.reset()
        try:
            self.runner.free(ids)
        except Exception:
            log.exception("free after a failed execute")


def stop_when_parent_exits(parent_pid: int, poll_s: float = 0.5) -> threading.Event:
    """An Event set once this process's parent (pid parent_pid) is gone, SIGKILLed included
    (the process is re-parented, so getppid() changes): a worker child started by `sarathi
    serve` or a rank started by the TP/PP launcher must not outlive what started it."""
    stop = threading.Event()

    def watch() -> None:
        while os.getppid() == parent_pid and not stop.is_set():
            time.sleep(poll_s)
        stop.set()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return stop


def run_worker(config: WorkerServiceConfig, *, runner: ServedRunner | None = None,
               stop: threading.Event | None = None, ready: threading.Event | None = None,
               kv_link=None) -> None:
    """Load config.engine's model and serve it on config.address until `stop` is set (forever
    when None); rank r of a replica (config.parallel) binds shared.config.rank_address(address, r).

    runner: serve this object instead of loading a model (tests, the simulated worker). ready:
    set once the socket is bound and the model is loaded. kv_link(runner, kv_address) -> a
    KvLinkLike or None: makes the worker's KV link (kvstore.link.make_kv_link; the caller passes
    it, worker_svc does not import kvstore); None: this worker neither sends nor receives KV.
    Raises SystemExit(3) when a fatal error (a lost rank) stopped the server.
    """
    address, parallel = config.address, config.parallel
    if parallel is not None:
        address = rank_address(address, parallel.rank)
    # before the model loads: a refused address should not cost a minute of loading first
    link_auth.check_bind(address, link_auth.process_keys("worker"), "the worker")
    if runner is None:
        from worker_svc.model_runner import ModelRunner  # torch: imported only where a model runs
        runner = ModelRunner(config.engine, parallel=parallel)
    link = kv_link(runner, config.kv_address) if kv_link is not None else None
    server = WorkerServer(runner, address, role=config.role, kv_link=link)
    log.info("worker (%s) serving %s on %s%s", config.role, runner.model_info.name, server.address,
             f", KV receiver on {server.kv_address}" if server.kv_address else "")
    if ready is not None:
        ready.set()
    try:
        server.serve_forever(stop)
    finally:
        server.close()
    if server.fatal is not None:
        log.error("worker stopped: %s", server.fatal)
        raise SystemExit(3)
