"""Prefill/decode disaggregation with real workers: the model runner behind the worker
service, KV blocks sent worker to worker over ZeroMQ (kvstore.link), the scheduler service over
pools (scheduler_svc.service.SchedulerService running a PoolSet). Greedy output with
--disaggregation all equals the colocated output: the KV bytes moved are the bytes computed."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import msgpack
import pytest
import zmq

from kvstore.link import KvLink, KvTransferError, make_kv_link
from kvstore.transfer import export_frames
from shared.config import CacheConfig, DisaggConfig, SchedulerConfig, SchedulerServiceConfig, WorkerConfig
from tests.support.engine_helpers import make_tiny_checkpoint
from tests.support.sim_worker import ThreadedStack, collect, eventually, request
from worker_svc.model_runner import ModelRunner
from worker_svc.service import WorkerServer

NUM_BLOCKS, BS = 48, 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("disagg"), "llama")


def model_runner(model):
    return ModelRunner(WorkerConfig(model=str(model), dtype="float32", kv_cache_dtype="float32",
                                    weight_quant="none", cache=CacheConfig(BS, NUM_BLOCKS)))


class PDStack(ThreadedStack):
    """Workers (threads, real model runners) + the scheduler service over their pools + the queue."""

    def __init__(self, model, roles: list[str], mode: str, **disagg):
        servers = [WorkerServer(ex, "tcp://127.0.0.1:0", role=role,
                                kv_link=make_kv_link(ex, "tcp://127.0.0.1:0" if role != "prefill" else None))
                   for role in roles for ex in [model_runner(model)]]
        addrs = {r: [s.address for s in servers if s.role == r] for r in ("mixed", "prefill", "decode")}
        config = SchedulerServiceConfig(
            SchedulerConfig(max_num_seqs=16, token_budget=32, watermark=0.0),
            worker_addrs=addrs["mixed"], metrics_port=0, metrics_host="127.0.0.1",
            disagg=DisaggConfig(addrs["prefill"], addrs["decode"], separate_mixed=True, mode=mode, **disagg))
        super().__init__(servers, config, ready_s=60)

    def run(self, reqs, timeout=120):
        events = asyncio.run(collect(self.gq, reqs, timeout=timeout))
        return {rid: [e.token_id for e in evs if e.token_id is not None] for rid, evs in events.items()}, events

    def stats(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.service.http_port}/stats", timeout=5) as r:
            return json.loads(r.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.service.http_port}/metrics", timeout=5) as r:
            return r.read().decode()


def reqs():
    # prompts of 5..70 tokens: partial and full last blocks, several chunks at tau 32
    # penalties read the tokens before the chunk: the decode worker must be sent the history
    return [request(f"q{i}", n, max_tokens=8, ignore_eos=True) for i, n in enumerate([5, 16, 33, 47, 70])] + [
        request("pen", 20, max_tokens=8, ignore_eos=True, presence_penalty=0.8, repetition_penalty=1.3)]


@pytest.fixture(scope="module")
def colocated(model):
    s = PDStack(model, ["mixed"], "off")
    try:
        yield s.run(reqs())[0]
    finally:
        s.close()


def test_greedy_output_with_disaggregation_all_equals_colocated(model, colocated):
    s = PDStack(model, ["prefill", "decode"], "all")
    try:
        out, events = s.run(reqs())
        assert out == colocated
        assert all([e.index for e in evs] == list(range(8)) for evs in events.values())
        st = s.stats()
        moved = {t["req_id"]: t for t in st["kv_transfers"]}
        assert sorted(moved) == sorted(out)
        ex = s.servers[0].runner
        per_block = 2 * len(ex.cache.k) * ex.cache.k[0][0].numel() * ex.cache.k[0].element_size()
        for r in reqs():   # the bytes moved are the prompt's blocks, K and V of every layer
            assert moved[r.req_id]["kv_bytes"] == -(-len(r.prompt_token_ids) // BS) * per_block
            assert moved[r.req_id]["kv_transfer_s"] > 0
        assert eventually(lambda: all(p["num_free_blocks"] == p["num_total_blocks"] and p["reserved"] == 0
                                      for p in s.stats()["pools"]))
        text = s.metrics()
        assert "sarathi_scheduler_kv_transfer_seconds_count 6.0" in text
        assert 'sarathi_scheduler_pool_up{pool="decode0",role="decode"} 1.0' in text
        assert 'sarathi_scheduler_disagg_ttft_phase_seconds_count{phase="transfer"} 6.0' in text
    finally:
        s.close()


def test_auto_disaggregates_long_prompts_only_with_colocated_output_and_a_dead_receiver_times_out(model, colocated):
    s = PDStack(model, ["prefill", "decode"], "auto", threshold_tokens=33)
    try:
        out, _ = s.run(reqs())
        assert out == colocated
        assert sorted(t["req_id"] for t in s.stats()["kv_transfers"]) == ["q2", "q3", "q4"]
    finally:
        s.close()
    link = KvLink(s.servers[0].runner.cache)
    with pytest.raises(KvTransferError, match="timeout"):
        link.send([0], "tcp://127.0.0.1:9", [1], timeout_s=0.3)    # nobody receives there
    link.close()


def test_a_transfer_that_arrives_after_its_lease_guard_is_refused_and_writes_nothing(model):
    src, dst = model_runner(model), model_runner(model)
    src.cache.k[0][3].fill_(1.0)
    receiver = KvLink(dst.cache, "tcp://127.0.0.1:0")
    sender = KvLink(src.cache)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    try:
        raw.connect(receiver.address)
        header, data = export_frames(src.cache, [3])
        receiver.receiver.expect("r7", [5], lease_s=5.0)     # the scheduler's announcement
        late = {"id": 7, "req_id": "r7", "dst_blocks": [5], "kv": header, "accept_until": time.time() - 1}
        raw.send_multipart([msgpack.packb(late), data])
        assert raw.poll(5000)
        reply = msgpack.unpackb(raw.recv())
        assert reply["id"] == 7 and not reply["ok"] and "refused" in reply["error"]
        assert float(dst.cache.k[0][5].abs().sum()) == 0.0
        seconds, nbytes = sender.send([3], receiver.address, [5], timeout_s=5.0, req_id="r7")
        assert nbytes > 0 and bool((dst.cache.k[0][5] == 1.0).all())
    finally:
        raw.close(0)
        sender.close()
        receiver.close()
