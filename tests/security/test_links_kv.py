"""Worker -> worker KV links with keys, over real TCP sockets: a KV receiver writes a transfer only
when the scheduler announced it (request id, exactly these blocks, within the lease) and a worker
key sent it. Anything else (unannounced, other blocks, late, replayed, cancelled, announced by a
worker key, sent by a stranger) writes nothing."""
from __future__ import annotations

import threading
import time

import msgpack
import pytest
import torch
import zmq

from kvstore.link import KvReceiver, KvSender, KvTransferError
from kvstore.transfer import export_frames
from scheduler_svc.remote_executor import RemoteExecutor
from shared import link_auth
from shared.config import ModelInfo
from shared.messages import Batch, BatchOutput, KvSend, SeqChunk
from shared.sampling import SamplingParams
from tests.support.worker_threads import serving
from worker_svc.service import WorkerServer

LOOPBACK = "tcp://127.0.0.1:0"


class Cache:
    """kvstore.transfer's duck-typed paged cache: 2 layers of [blocks, block_size, heads, dim]."""

    def __init__(self, fill: float = 0.0, num_blocks: int = 8):
        self.k = [torch.full((num_blocks, 4, 2, 8), fill) for _ in range(2)]
        self.v = [torch.full((num_blocks, 4, 2, 8), fill) for _ in range(2)]

    def block(self, b: int) -> float:
        return float(self.k[0][b].sum() + self.v[1][b].sum())


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    out = tmp_path_factory.mktemp("kvlinks") / "keys"
    link_auth.write_key_set(out)
    return link_auth.load_keys_dir("worker", out), link_auth.load_keys_dir("scheduler", out)


@pytest.fixture
def receiver(keys):
    r = KvReceiver(Cache(), LOOPBACK, keys=keys[0])
    yield r
    r.close()


@pytest.fixture
def sender(keys):
    s = KvSender(Cache(fill=1.0), keys=keys[0])
    yield s
    s.close()


def eventually(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def announce(address: str, msg: dict, k: link_auth.LinkKeys | None) -> None:
    """What RemoteExecutor sends: one frame on a DEALER with the given client keys."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    if k is not None:
        link_auth.connect_curve(sock, k)
    sock.connect(address)
    sock.send(msgpack.packb(msg))
    sock.close()


def expect(receiver, scheduler, req: str, blocks: list[int], lease_s: float = 10.0) -> None:
    announce(receiver.address, link_auth.kv_expect_msg(req, blocks, lease_s), scheduler)
    assert eventually(lambda: req in receiver.expected)


def test_an_announced_transfer_from_a_worker_is_written_once(keys, receiver, sender):
    expect(receiver, keys[1], "a", [5, 6])
    _, nbytes = sender.send([2, 3], receiver.address, [5, 6], timeout_s=5.0, req_id="a")
    assert nbytes > 0 and receiver.cache.block(5) == receiver.cache.block(6) > 0
    sender.cache.k[0][2].fill_(9.0)
    with pytest.raises(KvTransferError, match="no transfer for request 'a' was announced"):
        sender.send([2, 3], receiver.address, [5, 6], timeout_s=5.0, req_id="a")   # a replay
    assert float(receiver.cache.k[0][5].max()) == 1.0


def test_an_unannounced_transfer_writes_nothing(receiver, sender):
    with pytest.raises(KvTransferError, match="announced"):
        sender.send([2], receiver.address, [5], timeout_s=5.0, req_id="a")
    assert receiver.cache.block(5) == 0.0 and receiver.num_received == 0


def test_a_transfer_into_other_blocks_than_announced_writes_nothing(keys, receiver, sender):
    expect(receiver, keys[1], "a", [5, 6])
    with pytest.raises(KvTransferError, match="not the ones announced"):
        sender.send([2, 3], receiver.address, [6, 7], timeout_s=5.0, req_id="a")
    assert receiver.cache.block(6) == receiver.cache.block(7) == 0.0


def test_a_transfer_after_its_lease_writes_nothing(keys, receiver, sender):
    expect(receiver, keys[1], "a", [5], lease_s=0.2)
    time.sleep(0.3)
    with pytest.raises(KvTransferError, match="refused"):
        sender.send([2], receiver.address, [5], timeout_s=5.0, req_id="a")
    assert receiver.cache.block(5) == 0.0


def test_a_cancelled_transfer_writes_nothing(keys, receiver, sender):
    expect(receiver, keys[1], "a", [5])
    announce(receiver.address, link_auth.kv_cancel_msg("a"), keys[1])
    assert eventually(lambda: "a" not in receiver.expected)
    with pytest.raises(KvTransferError, match="announced"):
        sender.send([2], receiver.address, [5], timeout_s=5.0, req_id="a")
    assert receiver.cache.block(5) == 0.0


def test_a_worker_key_cannot_announce_a_transfer(keys, receiver, sender):
    announce(receiver.address, link_auth.kv_expect_msg("a", [5], 10.0), keys[0])
    expect(receiver, keys[1], "probe", [1])   # the scheduler's later announcement lands; the worker's did not
    assert "a" not in receiver.expected
    with pytest.raises(KvTransferError, match="announced"):
        sender.send([2], receiver.address, [5], timeout_s=5.0, req_id="a")
    assert receiver.cache.block(5) == 0.0


@pytest.mark.parametrize("client", ["plain", "unknown key", "scheduler key"])
def test_blocks_from_anyone_but_a_worker_are_not_written(keys, receiver, client):
    """Even for an announced request, with a valid lease, a stranger's or the scheduler's blocks
    are not written (a stranger does not get past the handshake)."""
    expect(receiver, keys[1], "a", [5])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # a refused handshake drops the connection: a DEALER with no peer would block its send
    # (libzmq queues only while a connection is pending), so the send may time out instead
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    if client == "unknown key":
        pub, sec = zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = pub, sec, keys[0].public
    elif client == "scheduler key":
        link_auth.connect_curve(sock, keys[1])
    header, raw = export_frames(Cache(fill=3.0), [0])
    sock.connect(receiver.address)
    try:
        sock.send_multipart([msgpack.packb({"id": 1, "req_id": "a", "dst_blocks": [5], "kv": header,
                                            "accept_until": time.time() + 10}), raw])
        reply = msgpack.unpackb(sock.recv()) if sock.poll(1000) else None
    except zmq.Again:
        assert client != "scheduler key"   # a key the receiver knows always gets a connection
        reply = None
    sock.close(0)
    assert reply is None if client != "scheduler key" else not reply["ok"]
    assert receiver.cache.block(5) == 0.0 and "a" in receiver.expected


def test_a_transfer_without_accept_until_is_refused(tmp_path):
    receiver = KvReceiver(Cache(), f"ipc://{tmp_path}/kv.sock", keys=None)
    try:
        receiver.expect("a", [5], 10.0)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(receiver.address)
        header, raw = export_frames(Cache(fill=3.0), [0])
        sock.send_multipart([msgpack.packb({"id": 1, "req_id": "a", "dst_blocks": [5], "kv": header}), raw])
        assert sock.poll(5000)
        reply = msgpack.unpackb(sock.recv())
        sock.close(0)
        assert not reply["ok"] and "accept_until" in reply["error"]
        assert receiver.cache.block(5) == 0.0
    finally:
        receiver.close()


class PrefillRunner:
    """A stand-in prefill worker: samples token 7; its cache holds 1.0 everywhere. `gate`, when
    set, holds execute() until it is set (a batch in flight)."""

    model_info = ModelInfo("prefill", max_model_len=64, vocab_size=100, eos_token_ids=[0],
                           block_size=4, num_blocks=8)

    def __init__(self, gate: threading.Event | None = None):
        self.cache, self.gate = Cache(fill=1.0), gate

    def execute(self, batch):
        if self.gate is not None:
            self.gate.wait(10)
        return BatchOutput(batch.batch_id, {s.req_id: 7 for s in batch.seqs if s.sample}, {})

    def free(self, ids):
        pass


@pytest.fixture
def prefill(keys):
    from kvstore.link import KvLink

    with serving() as run:
        yield lambda runner: run(WorkerServer(runner, LOOPBACK, keys=keys[0],
                                              kv_link=KvLink(runner.cache, keys=keys[0])))


def handoff_batch(receiver) -> Batch:
    seq = SeqChunk("a", [1, 2, 3, 4, 5], 0, [0, 1], True, SamplingParams(temperature=0.0))
    return Batch(0, [seq], kv_sends=[KvSend("a", [0, 1], receiver.address, [5, 6], 5.0)])


def test_the_scheduler_announces_a_batch_kv_sends_and_the_blocks_arrive(keys, receiver, prefill):
    remote = RemoteExecutor(prefill(PrefillRunner()), timeout_s=10, keys=keys[1])
    try:
        out = remote.execute(handoff_batch(receiver))
        assert "a" in out.kv_sent and not out.kv_failed
        assert receiver.cache.block(5) == receiver.cache.block(6) > 0 and receiver.expected == {}
    finally:
        remote.close()


def test_a_transfer_of_a_batch_given_up_on_is_cancelled_and_writes_nothing(keys, receiver, prefill):
    gate = threading.Event()
    remote = RemoteExecutor(prefill(PrefillRunner(gate)), timeout_s=10, keys=keys[1])
    try:
        remote.wait_ready(10)
        remote.submit(handoff_batch(receiver))
        assert eventually(lambda: "a" in receiver.expected)
        remote.abandon()     # the scheduler gives the batch up and will reuse blocks 5 and 6
        assert eventually(lambda: "a" not in receiver.expected)
        gate.set()           # the prefill worker finishes the batch and sends anyway
        assert eventually(lambda: receiver.num_refused == 1)
        assert receiver.cache.block(5) == receiver.cache.block(6) == 0.0
    finally:
        gate.set()
        remote.close()


def test_a_message_larger_than_the_cache_drops_its_sender_and_the_receiver_goes_on(tmp_path):
    receiver = KvReceiver(Cache(), f"ipc://{tmp_path}/kv.sock", keys=None)
    sender = KvSender(Cache(fill=1.0), keys=None)
    try:
        receiver.expect("a", [5], 10.0)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(receiver.address)
        header, _ = export_frames(Cache(fill=3.0), [0])
        sock.send_multipart([msgpack.packb({"id": 1, "req_id": "a", "dst_blocks": [5], "kv": header,
                                            "accept_until": time.time() + 10}), b"x" * (4 << 20)])
        assert not sock.poll(1000)            # no ack: the connection was dropped unread
        sock.close(0)
        sender.send([2], receiver.address, [5], timeout_s=5.0, req_id="a")
        assert receiver.cache.block(5) > 0 and receiver.num_refused == 0
    finally:
        sender.close()
        receiver.close()


def test_a_send_to_a_receiver_that_reads_nothing_gives_up_within_its_lease():
    stuck = zmq.Context.instance().socket(zmq.ROUTER)    # accepts connections, never reads
    stuck.setsockopt(zmq.LINGER, 0)
    stuck.bind(LOOPBACK)
    sender = KvSender(Cache(fill=1.0), keys=None)
    try:
        address = stuck.getsockopt(zmq.LAST_ENDPOINT).decode()
        for _ in range(3):
            t0 = time.monotonic()
            with pytest.raises(KvTransferError, match="timeout"):
                sender.send([0, 1, 2], address, [0, 1, 2], timeout_s=0.3, req_id="a")
            assert time.monotonic() - t0 < 1.0
            assert sender._socks == {}             # its queue went with the socket
    finally:
        sender.close()
        stuck.close(0)
