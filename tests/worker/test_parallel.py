"""Tensor and pipeline parallelism over torch.distributed (gloo, one process per rank, 1 thread
each): `sarathi worker --tp T --pp P` replicas driven by the real scheduler over ZeroMQ give the
greedy tokens a single in-process model runner gives for the very same batches (hybrid batches with
chunked prefills and a preemption); with PP=2 two micro-batches are on the stages at once; bad
layouts are refused before any weight is read; a rank that dies is reported within seconds."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.remote_executor import RemoteExecutor, WorkerError, WorkerLayoutError, WorkerLostError
from shared.sampling import SamplingParams
from tests.support.e2e_stack import ROOT
from tests.support.engine_helpers import make_executor, make_tiny_checkpoint, use_threads
from tests.support.parallel_helpers import BS, Replica, children_alive, make_scheduler, make_wide_checkpoint, run

NUM_BLOCKS = 18          # 288 token slots: the requests below need more, so some are preempted
TOKEN_BUDGET = 24        # tau: prompts of 30-60 tokens are prefilled in chunks
MAX_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def _threads():
    yield from use_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", seed=3)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in (30, 45, 60, 38, 52, 33)]


@pytest.fixture(scope="module")
def reference(tiny):
    """TP=1, one process: outputs for 1 and 2 micro-batches in flight (the batches differ)."""
    ex = make_executor(tiny, num_blocks=NUM_BLOCKS, block_size=BS)
    refs = {}
    for depth in (1, 2):
        outs, sched, _ = run(ex, depth, prompts(), MAX_TOKENS, NUM_BLOCKS, TOKEN_BUDGET,
                             ex.model_info)
        refs[depth] = (outs, sched.stats())
    return refs


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_parallel_replica_gives_the_single_rank_greedy_tokens(tmp_path, tiny, reference, tp, pp):
    rep = Replica(tmp_path, str(tiny), tp, pp, NUM_BLOCKS)
    try:
        assert rep.remote.parallel == {"rank": 0, "world_size": tp * pp, "tp": tp, "pp": pp,
                                       **({"layers": [0, 2 // pp]} if tp * pp > 1 else {})}
        assert len(rep.remote.addresses) == tp * pp          # found from rank 0's address alone
        outs, sched, loop = run(rep.remote, pp, prompts(), MAX_TOKENS, NUM_BLOCKS, TOKEN_BUDGET,
                                rep.remote.model_info, record=True)
    finally:
        rep.close()
    ref_outs, ref_stats = reference[pp]
    assert sched.stats()["num_preemptions"] == ref_stats["num_preemptions"] >= 1
    # every prompt is longer than tau, so every prompt was prefilled in chunks
    assert max(e["num_tokens"] for e in loop.trace) <= TOKEN_BUDGET < min(map(len, prompts()))
    assert outs == ref_outs
    assert all(len(o) == MAX_TOKENS for o in outs)


def test_pp2_keeps_two_micro_batches_on_the_stages_at_once(tmp_path):
    """Timestamps from the ranks: stage 0 computes batch k+1 while stage 1 computes batch k;
    and no request is in two batches in flight."""
    rep = Replica(tmp_path, str(make_wide_checkpoint(tmp_path)), 1, 2, 256)
    try:
        long_prompts = [[2 + i % 250 for i in range(n)] for n in (300, 280, 260, 290, 270, 310)]
        _, _, loop = run(rep.remote, 2, long_prompts, 4, 256, 128, rep.remote.model_info,
                         record=True)
    finally:
        rep.close()
    trace = loop.trace
    by_id = {e["batch_id"]: e for e in trace}
    for e in trace:                         # the invariant, batch by batch
        for other in e["in_flight"]:
            assert not set(e["req_ids"]) & set(by_id[other]["req_ids"])
    assert max(len(e["in_flight"]) for e in trace) == 1        # a second batch was submitted

    def busy(e, rank):   # compute interval of a rank (time.time()), excluding the recv wait
        t = e["timings"]
        end = t[f"rank{rank}_end"]
        return end - (t[f"rank{rank}_total_s"] - t[f"rank{rank}_recv_wait_s"]), end

    overlaps = []        # seconds both stages computed at once, batch k on 1 and k + 1 on 0
    for k, e in enumerate(trace[:-1]):
        s1, e1 = busy(e, 1)
        s0, e0 = busy(trace[k + 1], 0)
        overlaps.append(max(0.0, min(e0, e1) - max(s0, s1)))
    real = [o for o in overlaps if o > 0.002]
    assert len(real) >= 3, f"overlaps (s): {overlaps}"


def test_torchrun_starts_one_rank_per_process(tmp_path, tiny, reference):
    """`torchrun --nproc-per-node 2 -m sarathi.cli worker --tp 2`: rank, world size and the
    rendezvous come from torchrun's environment; the scheduler is given both addresses."""
    from tests.support.redis_fixture import free_port

    addr = f"ipc://{tmp_path}/tr.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SARATHI_")}
    log = tmp_path / "torchrun.log"
    proc = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "sarathi.cli", "worker", "--tp", "2",
         "--model", str(tiny), "--bind", addr, "--threads", "1", "--dtype", "float32",
         "--kv-cache-dtype", "float32", "--weight-quant", "none",    # the float path, as Replica
         "--num-blocks", str(NUM_BLOCKS)],
        cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    remote = RemoteExecutor([addr, f"{addr}.rank1"], timeout_s=30)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                remote.wait_ready(2.0)
                break
            except WorkerError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        assert remote.parallel["world_size"] == 2
        outs, _, _ = run(remote, 1, prompts(), MAX_TOKENS, NUM_BLOCKS, TOKEN_BUDGET,
                         remote.model_info)
        assert outs == reference[1][0]
    finally:
        remote.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


@pytest.mark.parametrize("args,env,message", [
    (["--tp", "3"], {}, r"attention heads \(4\) are not divisible by tp=3"),
    (["--pp", "3"], {}, r"3 pipeline stages but the model has only 2 layers"),
    (["--pp", "2", "--pp-layers", "2,1"], {}, r"--pp-layers 2,1 must give 2 stages"),
    (["--tp", "2", "--rank", "0"], {"WORLD_SIZE": "4"}, r"tp x pp = 2 x 1 = 2 ranks, but the world size is 4"),
])
def test_bad_layout_is_a_clear_error_before_any_weight_is_read(tiny, tmp_path, args, env, message, monkeypatch,
                                                              capsys):
    """`sarathi worker`'s own entry point, in this process (the exit code is what main returns;
    test_parallel_smollm2 runs the same refusal as a real process)."""
    from sarathi import cli as sarathi_cli

    # weights truncated to nothing: an error about them would mean they were read first
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"")
    for k in [k for k in os.environ if k.startswith("SARATHI_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc = sarathi_cli.main(["worker", "--model", str(broken), "--bind", f"ipc://{tmp_path}/x.sock", *args])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert re.search(message, err.strip().splitlines()[-1]), err[-2000:]


def test_scheduler_refuses_addresses_that_are_not_the_replicas_ranks(tmp_path, tiny):
    rep = Replica(tmp_path, str(tiny), 1, 2, 16)
    try:
        wrong = RemoteExecutor([rep.remote.addresses[1], rep.remote.addresses[0]], timeout_s=10)
        with pytest.raises(WorkerLayoutError, match="is rank 1 of 2"):
            wrong.wait_ready(10)
        wrong.close()
    finally:
        rep.close()


@pytest.mark.parametrize("tp,pp,victim", [(1, 2, 1), (2, 1, 0)])
def test_a_dead_rank_fails_the_batches_in_flight_within_seconds(tmp_path, tiny, tp, pp, victim):
    rep = Replica(tmp_path, str(tiny), tp, pp, 32, timeout_s=60)
    try:
        pids = rep.rank_pids()
        sched = make_scheduler(32, 64, model_info=rep.remote.model_info)
        for i in range(4):
            sched.add_request(f"r{i}", list(range(2, 40)), SamplingParams(temperature=0, max_tokens=200,
                                                                        ignore_eos=True))
        loop = EngineLoop(sched, rep.remote, pp)
        for _ in range(4):
            loop.step()
        os.kill(pids[victim], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerError) as err:
            for _ in range(50):
                loop.step()
        waited = time.monotonic() - t0
        assert waited < 10, f"took {waited:.1f}s: {err.value}"
        # a lost rank is a lost worker (the service holds and replays), not a failed batch
        assert isinstance(err.value, WorkerLostError), repr(err.value)
        rep.proc.wait(20)                  # the launcher stops the replica, non-zero
        assert rep.proc.returncode not in (0, None)
        assert not children_alive(pids)
    finally:
        rep.close()



def _outward_address() -> str | None:
    """An address of this machine other than loopback (none: None). A UDP connect sends nothing."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") else addr


def test_the_launcher_holds_the_rendezvous_port_on_loopback():
    """The launcher's rendezvous store listens before any rank starts: the port cannot be taken
    by another process in between (binding it again fails), a rank-style client on loopback
    reaches the store, and a connection from this machine's outward address is refused."""
    import datetime
    import socket

    import torch.distributed as dist

    from worker_svc.launcher import host_store

    store = host_store(2, timeout_s=5)
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", store.port))
        client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=datetime.timedelta(seconds=5))
        client.set("rank1", "here")
        assert store.get("rank1") == b"here"
        outward = _outward_address()
        if outward is not None:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((outward, store.port), timeout=5).close()
    finally:
        del store
