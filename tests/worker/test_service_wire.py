"""The worker service over real ZeroMQ, with a recording fake model runner (torch-free: this is about
the service plumbing, not the model): the worker rebuilds exactly the scheduler's batches, and
every failure comes back as a clear error reply."""
from __future__ import annotations

import contextlib
import itertools
import threading
import time

import pytest
import zmq

from scheduler_svc.remote_executor import RemoteExecutor, WorkerError, WorkerLostError, WorkerRestartedError
from shared.config import ModelInfo
from shared.messages import Batch, BatchOutput, SeqChunk
from shared.sampling import SamplingParams
from shared.wire import pack, unpack
from tests.support.worker_threads import serving
from worker_svc.service import WorkerServer


class RecordingRunner:
    """Samples token 1000 + output_index for every due row; records what it was given."""

    model_info = ModelInfo("fake", max_model_len=64, vocab_size=2000, eos_token_ids=[0])

    def __init__(self, fail_on: int | None = None):
        self.batches: list[Batch] = []
        self.freed: list[str] = []
        self.fail_on = fail_on

    def execute(self, batch: Batch) -> BatchOutput:
        if batch.batch_id == self.fail_on:
            raise RuntimeError("device on fire")
        self.batches.append(batch)
        return BatchOutput(batch.batch_id, {s.req_id: 1000 + s.output_index for s in batch.seqs if s.sample},
                           {"forward_s": 0.001})

    def free(self, req_ids):
        self.freed.extend(req_ids)


@pytest.fixture
def serve(tmp_path):
    names = itertools.count()
    with serving() as run:
        yield lambda runner, address=None: run(WorkerServer(runner, address or f"ipc://{tmp_path}/w{next(names)}.sock"))


def seq(req, toks, start, sample, out=0):
    return SeqChunk(req, toks, start, list(range((start + len(toks) + 3) // 4)), sample,
                    SamplingParams(temperature=0.0), out)


def three_batches():
    return [Batch(0, [seq("a", [1, 2, 3, 4, 5], 0, False)]),
            Batch(1, [seq("a", [6], 5, True), seq("b", [9, 9], 0, True)]),
            Batch(2, [seq("a", [1000], 6, True, 1), seq("b", [1000], 2, True, 1)])]


def test_worker_rebuilds_the_same_batches_and_returns_sampled_tokens(serve):
    ex = RecordingRunner()
    remote = RemoteExecutor(serve(ex), timeout_s=5)
    assert remote.model_info.name == "fake"
    outs = [remote.execute(b) for b in three_batches()]
    assert ex.batches == three_batches()
    assert outs[1].sampled == {"a": 1000, "b": 1000}
    assert {"forward_s", "decode_s", "worker_total_s", "rpc_s"} <= set(outs[2].timings)


class FirstStageRunner(RecordingRunner):
    """A rank that does not sample (e.g. the first pipeline stage): it never learns the tokens."""

    def execute(self, batch):
        super().execute(batch)
        return BatchOutput(batch.batch_id, {}, {})


def test_every_rank_rebuilds_the_batches_and_a_rank_that_does_not_sample_is_sent_the_tokens(serve):
    first, last = FirstStageRunner(), RecordingRunner()
    remote = RemoteExecutor(f"{serve(first)},{serve(last)}", timeout_s=5)
    outs = [remote.execute(b) for b in three_batches()]
    assert first.batches == last.batches == three_batches()
    assert outs[1].sampled == {"a": 1000, "b": 1000}  # from the last rank


def test_restarted_worker_gets_the_batch_resent_in_full(serve, tmp_path):
    addr = f"ipc://{tmp_path}/restart.sock"
    first = RecordingRunner()
    remote = RemoteExecutor(serve(first, addr), timeout_s=5)
    b0, b1, b2 = three_batches()
    remote.execute(b0)
    remote.execute(b1)
    # a second worker on a new address stands in for a restarted one: it knows no request
    second = RecordingRunner()
    remote2 = RemoteExecutor(serve(second), timeout_s=5)
    remote2.encoders[0].states = remote.encoders[0].states  # scheduler believes it sent a and b
    remote2.encoders[0].epoch = "stale"
    remote2.execute(b2)
    assert second.batches == [b2]


def test_worker_process_replaced_on_the_same_address_is_reported_as_lost_kv(tmp_path):
    addr = f"ipc://{tmp_path}/same.sock"
    servers = []

    def start():
        server = WorkerServer(RecordingRunner(), addr)
        stop = threading.Event()
        t = threading.Thread(target=server.serve_forever, args=(stop,), daemon=True)
        t.start()
        servers.append((server, stop, t))

    def stop_last():
        server, stop, t = servers[-1]
        stop.set()
        t.join(5)
        server.close()

    start()
    remote = RemoteExecutor(addr, timeout_s=5)
    b0, b1, b2 = three_batches()
    remote.execute(b0)
    stop_last()
    start()  # a new process: same address, empty KV cache
    # the link's monitor saw the old process go (lost), or the new one answered (restarted)
    with pytest.raises((WorkerLostError, WorkerRestartedError), match="KV cache is lost"):
        remote.execute(b1)
    remote.execute(Batch(3, [seq("c", [5, 6], 0, True)]))  # new work runs on the new worker
    stop_last()


def test_runner_failure_is_an_error_reply_and_the_next_batch_is_sent_in_full(serve):
    ex = RecordingRunner(fail_on=1)
    remote = RemoteExecutor(serve(ex), timeout_s=5)
    b0, b1, b2 = three_batches()
    remote.execute(b0)
    with pytest.raises(WorkerError, match="execute_failed.*device on fire"):
        remote.execute(b1)
    assert "a" in ex.freed
    remote.execute(b2)
    assert ex.batches[-1] == b2


def test_dead_worker_times_out_with_a_clear_error(tmp_path):
    remote = RemoteExecutor(f"ipc://{tmp_path}/nobody.sock", timeout_s=0.3)
    with pytest.raises(WorkerError, match="did not answer"):
        remote.execute(three_batches()[0])
    assert not remote.ping(0.1)


@pytest.mark.parametrize("payload,kind", [(b"\xc1garbage", "bad_request"),
                                          (pack({"op": "dance", "seq": 3}), "unknown_op"),
                                          (pack({"op": "batch", "seq": 4}), "bad_request")])
def test_malformed_messages_get_error_replies(serve, payload, kind):
    addr = serve(RecordingRunner())
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    s.send(payload)
    assert s.poll(5000)
    reply = unpack(s.recv())
    s.close()
    assert reply["ok"] is False and reply["error"] == kind and reply["message"]


def test_logprobs_and_prior_tokens_cross_the_wire(serve):
    class WithLogprobs(RecordingRunner):
        def execute(self, batch):
            out = super().execute(batch)
            out.logprobs = {s.req_id: [-0.5, [1000, 7], [-0.5, -2.0]] for s in batch.seqs if s.sample}
            return out

    ex = WithLogprobs()
    remote = RemoteExecutor(serve(ex), timeout_s=5)
    pen = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    first = SeqChunk("p", [5, 6], 8, list(range(3)), True, pen, 0, prior_token_ids=list(range(8)))
    out = remote.execute(Batch(0, [first]))
    assert out.logprobs == {"p": [-0.5, [1000, 7], [-0.5, -2.0]]}
    assert ex.batches[-1].seqs[0].prior_token_ids == list(range(8))   # a full entry carries them
    nxt = SeqChunk("p", [1000], 10, list(range(3)), True, pen, 1, prior_token_ids=list(range(8)) + [5, 6])
    remote.execute(Batch(1, [nxt]))
    assert ex.batches[-1].seqs[0].prior_token_ids is None              # a diff does not


def test_a_killed_worker_process_is_noticed_at_once_not_after_the_reply_timeout(tmp_path):
    """A worker process that dies mid-batch: the scheduler's wait ends within ~the heartbeat
    timeout (1.5 s), not after timeout_s (60 s here)."""
    import multiprocessing as mp
    import time

    addr = f"ipc://{tmp_path}/slow.sock"
    proc = mp.get_context("spawn").Process(target=_slow_worker, args=(addr,), daemon=True)
    proc.start()
    remote = RemoteExecutor(addr, timeout_s=60)
    remote.wait_ready(30)
    killer = threading.Timer(0.5, proc.kill)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(WorkerLostError, match="disconnected"):
        remote.execute(Batch(0, [seq("a", [1, 2], 0, True)]))   # the worker sleeps 30 s in it
    assert time.monotonic() - t0 < 2.0
    proc.join(5)
    remote.close()


class _SlowRunner(RecordingRunner):
    def execute(self, batch):
        import time
        time.sleep(30)
        return super().execute(batch)


def _slow_worker(addr: str) -> None:
    server = WorkerServer(_SlowRunner(), addr)
    server.serve_forever()


def test_a_frozen_worker_misses_its_heartbeats_and_is_noticed_within_2s(tmp_path):
    """SIGSTOP: the process and its ZeroMQ I/O thread stop, the TCP link stays open; only the
    missing heartbeat answers tell."""
    import multiprocessing as mp
    import os
    import signal
    import time

    from tests.support.redis_fixture import free_port

    addr = f"tcp://127.0.0.1:{free_port()}"
    proc = mp.get_context("spawn").Process(target=_slow_worker, args=(addr,), daemon=True)
    proc.start()
    try:
        remote = RemoteExecutor(addr, timeout_s=60)
        remote.wait_ready(30)
        threading.Timer(0.3, os.kill, args=(proc.pid, signal.SIGSTOP)).start()
        t0 = time.monotonic()
        with pytest.raises(WorkerLostError):
            remote.execute(Batch(0, [seq("a", [1, 2], 0, True)]))
        assert time.monotonic() - t0 < 2.5   # 0.3 s + heartbeat timeout 1.5 s + slack
        remote.close()
    finally:
        proc.kill()
        proc.join(5)


@contextlib.contextmanager
def hanging_up_listener():
    """(a tcp:// address, [connections accepted so far]) of a listener that hangs up on every
    connection: a link to it fails and reconnects ~1000 times a second (with RECONNECT_IVL 1)."""
    import socket as pysocket

    listener = pysocket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    accepted, done = [0], threading.Event()

    def hang_up():
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            conn.close()
            accepted[0] += 1

    t = threading.Thread(target=hang_up, daemon=True)
    t.start()
    try:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        done.set()
        t.join(2)
        listener.close()


def link_carries(ctx: zmq.Context, path: str) -> bool:
    """Whether a fresh ipc link of ctx (through its I/O thread) delivers a message in 3 s."""
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        server.bind(f"ipc://{path}")
        client.connect(f"ipc://{path}")
        client.send(b"ping")
        return bool(server.poll(3000)) and server.recv_multipart()[-1] == b"ping"
    finally:
        server.close(0)
        client.close(0)


def test_a_link_that_keeps_failing_unwatched_does_not_stall_the_context(tmp_path):
    """libzmq sends monitor events from the context's I/O thread with a blocking send: if 1000+
    events of a failing link wait unread (nobody looks at the links for a while), that thread
    must not block, or every socket of the context goes silent. A listener that hangs up on
    every connection makes the executor's link fail ~1000 times a second."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.RECONNECT_IVL, 1)   # retry at once: thousands of failed links in seconds
    with hanging_up_listener() as (addr, accepted):
        remote = RemoteExecutor(addr, timeout_s=1, ctx=ctx, keys=None)
        try:
            deadline = time.monotonic() + 20
            while accepted[0] < 3000 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert accepted[0] >= 3000, \
                f"the link stopped retrying after {accepted[0]} attempts: the I/O thread is stuck"
            assert link_carries(ctx, f"{tmp_path}/alive.sock"), \
                "a fresh link of the same context got no message through"
            assert remote.check_links() == []   # thousands of unread events are read at once: none was up
        finally:
            remote.close()
    ctx.term()


def test_closing_or_dropping_a_failing_link_does_not_stall_the_context(tmp_path):
    """A link's monitor is turned off before its reader goes: libzmq's next event to a reader
    that is gone is a send that blocks the context's I/O thread for good. Here the link fails
    ~1000 times a second (a listener that hangs up), so events are emitted while the executor
    closes, and again while one dropped without close() is collected; each time a fresh link
    of the same context must still carry a message."""
    import gc

    ctx = zmq.Context()
    ctx.setsockopt(zmq.RECONNECT_IVL, 1)
    wedged = False
    try:
        with hanging_up_listener() as (addr, _):
            for round_ in range(5):
                remote = RemoteExecutor(addr, timeout_s=1, ctx=ctx, keys=None)
                time.sleep(0.2)                     # the link is failing and reporting it
                sock, mon = remote.socks[0], remote.monitors[0]
                if round_ % 2:
                    del remote                      # dropped: collected without close()
                    gc.collect()
                else:
                    remote.close()
                wedged = not link_carries(ctx, f"{tmp_path}/r{round_}.sock")
                assert not wedged, f"round {round_}: a fresh link of the context got no message through"
                assert sock.closed and mon.closed, f"round {round_}: the link's sockets were left open"
    finally:
        if not wedged:              # a stalled context cannot be terminated: left to the process
            ctx.destroy(linger=0)
