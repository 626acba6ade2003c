"""KV-cache events in vLLM's wire format: a subscriber on a real ZeroMQ SUB socket decodes every
batch against the format's schema (msgpack arrays: [ts, events, dp_rank], events tagged first)
and keeps an index of the replica's cache, which must agree with the block manager's prefix cache
across allocation, prefix hits, eviction, preemption and a worker restart; a gap is filled from
the replay endpoint."""
from __future__ import annotations

import hashlib
import time

import msgpack
import pytest
import zmq
from prometheus_client import CollectorRegistry

from scheduler_svc.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventRecorder,
    ZmqEventPublisher,
    block_hash,
    cbor_block_key,
    decode_batch,
    prefix_hashes,
    root_hash,
    start_publisher,
)
from scheduler_svc.sim_executor import sim_engine
from shared.sampling import SamplingParams

BS = 4


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


class Subscriber:
    """What an external indexer does: SUB to the PUB socket, decode, apply to a hash set."""

    def __init__(self, endpoint: str, topic: bytes = b""):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.stored: dict[int, list[int]] = {}   # hash -> the block's tokens
        self.parent: dict[int, int | None] = {}
        self.seqs: list[int] = []
        self.events: list = []

    def apply(self, events) -> None:
        for e in events:
            self.events.append(e)
            if isinstance(e, BlockStored):
                assert e.block_size == BS and e.medium == "GPU" and e.lora_id is None
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    self.stored[h] = e.token_ids[i * BS:(i + 1) * BS]
                    self.parent[h] = parent
                    parent = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert h in self.stored, "removal of a block never stored"
                    del self.stored[h]
            else:
                assert isinstance(e, AllBlocksCleared)
                self.stored.clear()

    def pump(self, until, timeout=5.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "the events did not arrive"
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                ts, events, rank = decode_batch(payload)
                assert rank == 0 and abs(ts - time.time()) < 60
                self.apply(events)

    def close(self):
        self.sock.close(0)


def cached_hashes(loop, rec: KVEventRecorder) -> set[int]:
    """External hashes of every block the block manager can find by key now."""
    cache = loop.scheduler.block_manager.cache
    return {rec._ext[k] for k in cache._block_of}


@pytest.fixture
def setup():
    loop = sim_engine("sarathi", block_size=BS, num_blocks=12, token_budget=64, enable_prefix_caching=True,
                      max_model_len=64)
    rec = KVEventRecorder(BS, hash_seed="0")
    loop.scheduler.block_manager.events = rec
    pub = ZmqEventPublisher(rec, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv@pod-0@sim",
                            flush_interval_s=0.005)
    sub = Subscriber(pub.endpoint, b"kv@")
    time.sleep(0.2)   # the slow-joiner: let the subscription reach the PUB socket
    yield loop, rec, pub, sub
    sub.close()
    pub.close()


def test_block_hash_is_vllms_sha256_cbor_64bit_chain():
    # canonical CBOR (RFC 8949): [5, [1, 2, 3], None] and a 64-bit parent
    assert cbor_block_key(5, [1, 2, 3]) == bytes.fromhex("8305830102" "03f6")
    assert cbor_block_key(2 ** 63, [24, 256]) == bytes.fromhex("831b8000000000000000" "82" "1818" "190100" "f6")
    assert root_hash("0") == int.from_bytes(hashlib.sha256(b"\x61\x30").digest()[-8:], "big")
    b0 = block_hash(root_hash("0"), [7, 8, 9, 10])
    assert b0 == int.from_bytes(hashlib.sha256(cbor_block_key(root_hash("0"), [7, 8, 9, 10])).digest()[-8:], "big")
    assert prefix_hashes([7, 8, 9, 10, 11, 12, 13, 14, 15], 4) == [b0, block_hash(b0, [11, 12, 13, 14])]
    assert root_hash("1") != root_hash("0") and 0 <= b0 < 2 ** 64


def test_events_follow_allocation_prefix_hits_eviction_preemption_and_restart(setup):
    loop, rec, pub, sub = setup
    prompt = list(range(100, 110))                        # 2 full blocks + 2 tokens
    loop.add_request("a", prompt, greedy(3))
    loop.run_until_done()
    # allocate: every full block computed (prompt, then the generated tokens) is announced once
    sub.pump(lambda: set(sub.stored) == cached_hashes(loop, rec) and len(sub.stored) == 3)
    expected = prefix_hashes(prompt, BS)                  # what an indexer computes from the prompt
    assert set(expected) <= set(sub.stored) and sub.parent[expected[1]] == expected[0]
    first = next(e for e in sub.events if isinstance(e, BlockStored))
    assert first.parent_block_hash is None and first.token_ids[:BS] == prompt[:BS]
    assert first.block_hashes[0] == expected[0]

    # prefix hit: the same prompt again reuses the cached blocks: nothing new for them
    n_stored = sum(isinstance(e, BlockStored) for e in sub.events)
    hits = loop.scheduler.stats()["prefix_cache_hit_tokens"]
    loop.add_request("b", prompt, greedy(1))
    loop.run_until_done()
    assert loop.scheduler.stats()["prefix_cache_hit_tokens"] - hits == 2 * BS
    time.sleep(0.05)
    sub.pump(lambda: set(sub.stored) == cached_hashes(loop, rec))
    assert sum(isinstance(e, BlockStored) for e in sub.events) == n_stored  # nothing re-announced

    # eviction: prompts that need every block push the cached ones out: BlockRemoved for each
    for i in range(3):
        loop.add_request(f"big{i}", list(range(1000 + 40 * i, 1000 + 40 * i + 40)), greedy(2))
        loop.run_until_done()
    sub.pump(lambda: set(sub.stored) == cached_hashes(loop, rec))
    removed = {h for e in sub.events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert set(expected) <= removed and not set(expected) & set(sub.stored)

    # preemption: a preempted request's blocks stay cached (no event) and are found again
    req = loop.add_request("p", list(range(200, 216)), greedy(6))
    loop.step()
    loop.step()
    assert req.num_output_tokens == 2
    before = len(sub.events)
    loop.scheduler._preempt(req)                           # what memory pressure does
    sub.pump(lambda: set(sub.stored) == cached_hashes(loop, rec))
    assert not any(isinstance(e, BlockRemoved) and set(e.block_hashes) & set(prefix_hashes(req.token_ids, BS))
                   for e in sub.events[before:])
    hits = loop.scheduler.stats()["prefix_cache_hit_tokens"]
    loop.run_until_done()
    assert req.finish_reason == "length"
    assert loop.scheduler.stats()["prefix_cache_hit_tokens"] - hits == 4 * BS   # resumed from cache
    sub.pump(lambda: set(sub.stored) == cached_hashes(loop, rec))

    # worker restart: its KV tensors are gone: AllBlocksCleared, then only new blocks
    loop.scheduler.on_workers_lost()
    sub.pump(lambda: isinstance(sub.events[-1], AllBlocksCleared))
    assert sub.stored == {} and cached_hashes(loop, rec) == set()
    loop.add_request("after", prompt, greedy(1))
    loop.run_until_done()
    sub.pump(lambda: set(sub.stored) == cached_hashes(loop, rec) and sub.stored)
    assert set(expected) <= set(sub.stored)               # recomputed and announced again
    assert sub.seqs == list(range(len(sub.seqs)))          # in order, no gap


def test_replay_endpoint_resends_missed_batches_then_the_end_marker(setup):
    loop, rec, pub, sub = setup
    for i in range(3):
        loop.add_request(f"r{i}", list(range(10 * i + 1, 10 * i + 9)), greedy(1))
        loop.run_until_done()
        sub.pump(lambda: set(sub.stored) == cached_hashes(loop, rec))
    assert len(sub.seqs) >= 2
    dealer = zmq.Context.instance().socket(zmq.DEALER)   # a REQ-shaped client: empty delimiter
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    try:
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        got = []
        while True:
            assert dealer.poll(5000)
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                assert payload == b""
                break
            got.append((int.from_bytes(seq, "big"), payload))
        assert [s for s, _ in got] == sub.seqs[1:]
        live = [e for s, p in got for e in decode_batch(p)[1]]
        assert live and live == sub.events[len(sub.events) - len(live):]   # the same batches again
    finally:
        dealer.close(0)


def test_the_wire_is_positional_msgpack_with_the_tag_first():
    from scheduler_svc.kv_events import encode_batch

    raw = msgpack.unpackb(encode_batch(12.5, [BlockStored([1, 2], None, list(range(8)), 4),
                                              BlockRemoved([2]), AllBlocksCleared()], 0))
    assert raw == [12.5, [["BlockStored", [1, 2], None, list(range(8)), 4, None, "GPU", None],
                          ["BlockRemoved", [2], "GPU"], ["AllBlocksCleared"]], 0]
    with pytest.raises(ValueError):
        decode_batch(msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 4, None, "GPU", None]]]))


def test_a_restarted_worker_through_the_service_clears_the_index():
    """The service's path for a restarted worker (WorkerRestartedError) ends in AllBlocksCleared."""
    from scheduler_svc.metrics import SchedulerMetrics
    from scheduler_svc.remote_executor import WorkerRestartedError
    from scheduler_svc.service import SchedulerService, loop_engine
    from shared.queue import make_queues

    loop = sim_engine("sarathi", block_size=BS, num_blocks=32, enable_prefix_caching=True)
    rec = KVEventRecorder(BS)
    loop.scheduler.block_manager.events = rec
    loop.add_request("done", list(range(1, 18)), greedy(1))
    loop.run_until_done()
    assert any(isinstance(e, BlockStored) for e in rec.drain())
    loop.add_request("running", list(range(40, 50)), greedy(5))
    loop.step()

    class Restarted:
        def execute(self, batch):
            raise WorkerRestartedError("worker restarted")

    metrics = SchedulerMetrics(CollectorRegistry())
    service = SchedulerService(loop_engine(loop.scheduler, Restarted(), metrics), make_queues(None)[1], metrics)
    service._step()
    assert isinstance(rec.drain()[-1], AllBlocksCleared)


def test_the_scheduler_service_publishes_events_configured_as_vllms(tmp_path):
    """--kv-events-config end to end: a worker service, the scheduler service, a subscriber that
    finds a served prompt's blocks under the hashes it computes itself."""
    import asyncio
    import json

    from shared.config import SchedulerConfig, SchedulerServiceConfig
    from tests.support.redis_fixture import free_port
    from tests.support.sim_worker import BLOCK, SimWorker, ThreadedStack, collect, request
    from worker_svc.service import WorkerServer

    port = free_port()
    cfg = json.dumps({"endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint": None, "topic": "kv@pod@sim"})
    server = WorkerServer(SimWorker(), f"ipc://{tmp_path}/w.sock")
    stack = ThreadedStack([server], SchedulerServiceConfig(
        SchedulerConfig(max_num_seqs=4, token_budget=16, enable_prefix_caching=True, kv_events_config=cfg),
        worker_addrs=[server.address], metrics_port=None))
    sub = Subscriber(f"tcp://127.0.0.1:{port}", b"kv@pod@")
    try:
        time.sleep(0.2)
        asyncio.run(collect(stack.gq, [request("r", prompt_len=10, max_tokens=2)]))
        want = prefix_hashes(list(range(1, 11)), BLOCK)
        sub.pump(lambda: set(want) <= set(sub.stored))
    finally:
        sub.close()
        stack.close()


def test_a_publisher_beyond_loopback_needs_the_operators_opt_in(monkeypatch, caplog):
    """The events carry prompts' token ids, and their subscribers cannot authenticate: a socket
    listening on a network address is refused unless SARATHI_INSECURE_LINKS=1 says the network is
    trusted; connecting out to a subscriber (the endpoint picker's layout) needs no opt-in."""
    import json

    from shared.link_auth import LinkSecurityError
    from tests.support.redis_fixture import free_port

    monkeypatch.delenv("SARATHI_INSECURE_LINKS", raising=False)
    bm = sim_engine("sarathi", block_size=BS, num_blocks=12, token_budget=64, enable_prefix_caching=True,
                    max_model_len=64).scheduler.block_manager
    wide = json.dumps({"endpoint": f"tcp://0.0.0.0:{free_port()}", "replay_endpoint": None})
    with pytest.raises(LinkSecurityError, match="KV-cache event publisher"):
        start_publisher(wide, bm)
    replay = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": f"tcp://0.0.0.0:{free_port()}"})
    with pytest.raises(LinkSecurityError, match="replay"):
        start_publisher(replay, bm)
    out = start_publisher(json.dumps({"endpoint": f"tcp://10.255.255.1:{free_port()}", "connect": True,
                                      "replay_endpoint": None}), bm)
    out.close()
    monkeypatch.setenv("SARATHI_INSECURE_LINKS", "1")
    with caplog.at_level("WARNING"):
        pub = start_publisher(wide, bm)
    pub.close()
    assert "WITHOUT authentication" in caplog.text
