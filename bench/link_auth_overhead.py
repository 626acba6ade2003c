"""What CURVE costs on the scheduler <-> worker step round trip, plain and keyed, in the same run.

Two worker processes serve a stand-in model runner (it samples token 1 and computes nothing, so
the round trip is the link: encode, send, decode, reply) on loopback TCP: one plain, one with a
key set from `sarathi keys`. The scheduler side is the real RemoteExecutor. Rounds alternate
step by step between plain and keyed, so that the machine's load falls on both alike. Two cases:

* decode: 32 running requests, one token each (the wire's diffs: a few hundred bytes a step);
* prefill: one new request with a 2048-token chunk per step (a full entry, ~6-10 kB).

    python -m bench.link_auth_overhead [--steps 800 --prefill-steps 200 --rounds 3]
        [--out bench/results/security/link_auth_overhead.json]

Per case and link: median, p90 and mean of the round trip (microseconds; overhead = keyed
median / plain median - 1), and CPU microseconds per step of both processes together, measured
on each link alone (time on a shared machine moves with other load, CPU time much less).
Smoke-sized: well under a minute on two cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine
from scheduler_svc.remote_executor import RemoteExecutor
from shared import link_auth
from shared.config import cdiv
from shared.messages import Batch, SeqChunk
from shared.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE, BLOCKS_PER_REQ, DECODES = 16, 512, 32   # 8192 positions: room for every step
GREEDY = SamplingParams(temperature=0.0)

WORKER = f"""
import os
from shared.config import ModelInfo
from shared.messages import BatchOutput
from worker_svc.service import WorkerServer, stop_when_parent_exits

class Runner:
    model_info = ModelInfo("stand-in", max_model_len={BLOCK_SIZE * BLOCKS_PER_REQ}, vocab_size=100,
                           eos_token_ids=[0], block_size={BLOCK_SIZE}, num_blocks={BLOCKS_PER_REQ * (DECODES + 1)})
    def execute(self, batch):
        return BatchOutput(batch.batch_id, {{s.req_id: 1 for s in batch.seqs if s.sample}}, {{}})
    def free(self, ids):
        pass

server = WorkerServer(Runner(), "tcp://127.0.0.1:0")
print(server.address, flush=True)
server.serve_forever(stop_when_parent_exits(os.getppid()))
"""


def lscpu() -> dict:
    """The CPU's family and model as lscpu names them (empty where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {k: fields[k].strip() for k in ("Model name", "CPU family", "Model", "Stepping") if k in fields}


def start_worker(env: dict) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", WORKER], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    return proc, proc.stdout.readline().strip()


def decode_batch(step: int) -> Batch:
    pos = BLOCK_SIZE + step - 1   # each request holds 16 prompt tokens, then step - 1 decoded ones
    blocks = cdiv(pos + 1, BLOCK_SIZE)
    return Batch(step, [SeqChunk(f"r{j}", [1], pos, list(range(j * BLOCKS_PER_REQ, j * BLOCKS_PER_REQ + blocks)),
                                 True, GREEDY, step) for j in range(DECODES)])


def prefill_batch(step: int) -> Batch:
    n = 2048
    table = list(range(DECODES * BLOCKS_PER_REQ, DECODES * BLOCKS_PER_REQ + cdiv(n, BLOCK_SIZE)))
    return Batch(step, [SeqChunk(f"p{step}", [(i * 7) % 100 for i in range(n)], 0, table, True, GREEDY)],
                 freed_req_ids=[f"p{step - 1}"] if step else [])


def prime(remote: RemoteExecutor) -> None:
    """Install the decode requests (their prompts, in full) so that decode steps are diffs."""
    table = lambda j: [j * BLOCKS_PER_REQ]  # noqa: E731 - one block holds the 16 prompt tokens
    remote.execute(Batch(0, [SeqChunk(f"r{j}", list(range(1, BLOCK_SIZE + 1)), 0, table(j), False, GREEDY)
                             for j in range(DECODES)]))


def timed(remotes: dict[str, RemoteExecutor], make, first: int, steps: int, samples: dict, case: str) -> None:
    """Step by step, each link in turn (the order swapped every step): load that comes and goes
    falls on both links alike."""
    links = list(remotes)
    for i in range(first, first + steps):
        for link in (links if i % 2 else links[::-1]):
            batch = make(i)
            t0 = time.perf_counter()
            remotes[link].execute(batch)
            samples[case, link].append((time.perf_counter() - t0) * 1e6)


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_step(remote: RemoteExecutor, worker_pid: int, make, first: int, steps: int) -> float:
    """CPU microseconds per step on one link alone: this process (the scheduler's side, libzmq's
    I/O thread included) plus the worker process. Unlike wall time, hardly moved by other load."""
    c0, w0 = time.process_time(), proc_cpu_s(worker_pid)
    for i in range(first, first + steps):
        remote.execute(make(i))
    return (time.process_time() - c0 + proc_cpu_s(worker_pid) - w0) / steps * 1e6


def summary(us: list[float]) -> dict:
    us = sorted(us)
    return {"n": len(us), "median_us": round(statistics.median(us), 1),
            "p90_us": round(us[int(0.9 * (len(us) - 1))], 1), "mean_us": round(statistics.fmean(us), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=800, help="decode steps per round and link")
    ap.add_argument("--prefill-steps", type=int, default=200, help="prefill steps per round and link")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/security/link_auth_overhead.json")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        key_dir = Path(tmp) / "keys"
        link_auth.write_key_set(key_dir)
        plain_proc, plain_addr = start_worker({})
        keyed_proc, keyed_addr = start_worker({link_auth.ENV_DIR: str(key_dir)})
        remotes = {"plain": RemoteExecutor(plain_addr, timeout_s=30, keys=None),
                   "curve": RemoteExecutor(keyed_addr, timeout_s=30,
                                           keys=link_auth.load_keys_dir("scheduler", key_dir))}
        samples = {(case, link): [] for case in ("decode", "prefill") for link in remotes}
        cpu = {key: [] for key in samples}     # CPU us per step, one value per round
        pids = {"plain": plain_proc.pid, "curve": keyed_proc.pid}
        try:
            for remote in remotes.values():
                remote.wait_ready(30)
                prime(remote)
            warm = {key: [] for key in samples}
            timed(remotes, decode_batch, 1, 50, warm, "decode")
            step = 51
            for r in range(a.rounds):
                timed(remotes, decode_batch, step, a.steps, samples, "decode")
                step += a.steps
                timed(remotes, prefill_batch, step, a.prefill_steps, samples, "prefill")
                step += a.prefill_steps
                for case, make, n in (("decode", decode_batch, a.steps), ("prefill", prefill_batch, a.prefill_steps)):
                    # the same steps on each link (the same context lengths), in turn, the
                    # first link swapped every round
                    for link in (list(remotes) if r % 2 else list(remotes)[::-1]):
                        cpu[case, link].append(cpu_per_step(remotes[link], pids[link], make, step, n))
                    step += n
        finally:
            for remote in remotes.values():
                remote.close()
            for proc in (plain_proc, keyed_proc):
                proc.terminate()
                proc.wait(10)
    result = {"command": "python -m bench.link_auth_overhead " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": {**machine(), "lscpu": lscpu()},
              "cases": {"decode": f"{DECODES} decodes of one token (diffs)",
                        "prefill": "one new request, a 2048-token chunk (a full entry)"},
              "results": {}}
    for case in ("decode", "prefill"):
        plain, curve = summary(samples[case, "plain"]), summary(samples[case, "curve"])
        cpu_plain, cpu_curve = (statistics.median(cpu[case, link]) for link in ("plain", "curve"))
        result["results"][case] = {
            "round_trip": {"plain": plain, "curve": curve,
                           "overhead_median": round(curve["median_us"] / plain["median_us"] - 1, 4),
                           "added_median_us": round(curve["median_us"] - plain["median_us"], 1)},
            "cpu_per_step_us": {"plain": round(cpu_plain, 1), "curve": round(cpu_curve, 1),
                                "min_of_rounds": {link: round(min(cpu[case, link]), 1) for link in remotes},
                                "per_round": {link: [round(x, 1) for x in cpu[case, link]] for link in remotes},
                                "overhead": round(cpu_curve / cpu_plain - 1, 4),
                                "added_us": round(cpu_curve - cpu_plain, 1)}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["results"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
