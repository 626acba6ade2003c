"""Pipeline bubbles per batching policy: a real PP=2 replica, the real scheduler, the same load.

Starts `sarathi worker --pp 2 --threads 1` (SmolLM2 by default: layers 0-14 and 15-29, one
process and one torch thread per stage), drives it with the scheduler's EngineLoop (two
micro-batches in flight) under a Poisson arrival of requests whose prompt/decode lengths are
sampled from the ShareGPT length trace and scaled down, and reads each stage's compute interval
per micro-batch from the ranks' own timestamps (time.time(); busy = the stage's forward without
the wait for the previous stage's activations).

Per stage: busy and idle seconds per iteration; bubble fraction = idle / wall over the window from
the first to the last micro-batch (the same window for both stages). Also the iteration-time
variance per policy (what makes bubbles: a stage waits whenever its neighbour's micro-batch is
longer than its own) and a per-stage timeline (the shape of the SARATHI paper's Figure 8).

    python -m bench.pipeline_bubbles --policies sarathi [--requests 48 --qps 4 --scale 8]
        [--out bench/results/bubbles/pipeline_bubbles]   # one JSON per policy; --plot merges them

Run under the exclusive CPU lock; one policy per invocation keeps each under a few minutes.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine
from sarathi.measure.trace import DEFAULT_TRACE
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.remote_executor import RemoteExecutor
from scheduler_svc.scheduler import Scheduler
from shared.config import CacheConfig, SchedulerConfig
from shared.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def workload(n: int, scale: float, qps: float, seed: int, max_len: int, trace: Path):
    """n requests: (arrival s, prompt tokens, decode tokens), lengths from the trace / scale."""
    rows = list(csv.DictReader(trace.open()))
    rng = random.Random(seed)
    t, out = 0.0, []
    for row in rng.sample(rows, n):
        p = max(8, int(int(row["num_prefill_tokens"]) / scale))
        d = max(4, int(int(row["num_decode_tokens"]) / scale))
        p = min(p, max_len - d)
        out.append((t, p, d))
        t += rng.expovariate(qps)
    return out


def start_replica(tmp: str, pp: int, num_blocks: int, model: str | None, log: Path, pp_layers: str = ""):
    addr = f"ipc://{tmp}/pp.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SARATHI_")}
    cmd = [sys.executable, "-m", "sarathi.cli", "worker", "--pp", str(pp), "--threads", "1",
           "--dtype", "float32", "--num-blocks", str(num_blocks), "--bind", addr]
    if model:
        cmd += ["--model", model]
    if pp_layers:
        cmd += ["--pp-layers", pp_layers]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    remote = RemoteExecutor(addr, timeout_s=120)
    while True:
        try:
            remote.wait_ready(2.0)
            return proc, remote
        except Exception:
            if proc.poll() is not None:
                raise RuntimeError(f"replica exited:\n{log.read_text()[-3000:]}")


def drive(remote, policy: str, reqs, args) -> tuple[list[dict], dict]:
    info = remote.model_info
    cfg = SchedulerConfig(policy=policy, token_budget=args.token_budget, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_batched_tokens, max_model_len=info.max_model_len)
    t0 = time.monotonic()
    sched = Scheduler(cfg, CacheConfig(info.block_size, info.num_blocks), info,
                      clock=lambda: time.monotonic() - t0)
    loop = EngineLoop(sched, remote, remote.pipeline_depth, record=True)
    rng = random.Random(1)
    pending = list(enumerate(reqs))
    last_report = 0.0
    while pending or sched.has_unfinished():
        now = time.monotonic() - t0
        while pending and pending[0][1][0] <= now:
            i, (arr, p, d) = pending.pop(0)
            sched.add_request(f"r{i}", [rng.randrange(3, info.vocab_size) for _ in range(p)],
                              SamplingParams(temperature=0.0, max_tokens=d, ignore_eos=True), arrival_time=arr)
        if sched.has_unfinished():
            loop.step()
        elif pending:
            time.sleep(max(0.0, pending[0][1][0] - (time.monotonic() - t0)))
        if now - last_report > 10:
            last_report = now
            st = sched.stats()
            print(f"  {policy}: t={now:.0f}s arrived {len(reqs) - len(pending)}/{len(reqs)} "
                  f"running {st['running']} waiting {st['waiting']} finished {st['num_finished']}",
                  file=sys.stderr, flush=True)
    return loop.trace, sched.stats()


def analyse(trace: list[dict], pp: int, saturated: bool = False) -> dict:
    """Per-stage busy/idle per iteration and bubble fraction over the common window. saturated:
    only the micro-batches from the first to the last one planned while requests were waiting
    (the steady state under load, without the ramp-up and the decode-only tail)."""
    if saturated:
        busy_ids = [k for k, e in enumerate(trace) if e.get("waiting", 0) > 0]
        trace = trace[busy_ids[0]:busy_ids[-1] + 1] if busy_ids else trace
    stages = []
    for s in range(pp):
        iv = []
        for e in trace:
            t = e["timings"]
            end = t[f"rank{s}_end"]
            iv.append((end - (t[f"rank{s}_total_s"] - t[f"rank{s}_recv_wait_s"]), end))
        stages.append(iv)
    start = min(iv[0][0] for iv in stages)
    end = max(iv[-1][1] for iv in stages)
    wall = end - start
    out = {"wall_s": wall, "iterations": len(trace), "stages": []}
    for s, iv in enumerate(stages):
        busy = [b - a for a, b in iv]
        idle = [max(0.0, iv[0][0] - start)] + [max(0.0, iv[k][0] - iv[k - 1][1]) for k in range(1, len(iv))]
        idle_total = wall - sum(busy)
        out["stages"].append({
            "stage": s, "busy_s": sum(busy), "idle_s": idle_total, "bubble_fraction": idle_total / wall,
            "busy_per_iter_ms": _dist(busy), "idle_per_iter_ms": _dist(idle),
            "intervals": [[a - start, b - start] for a, b in iv]})
    busy0 = [b - a for a, b in stages[0]]
    out["iteration_time_cv"] = statistics.pstdev(busy0) / statistics.mean(busy0)
    out["bubble_fraction"] = statistics.mean(st["bubble_fraction"] for st in out["stages"])
    out["batch_tokens"] = [e["num_tokens"] for e in trace]
    out["batch_kind"] = [e.get("kind", "") for e in trace]
    return out


def _dist(xs: list[float]) -> dict:
    ms = sorted(x * 1000 for x in xs)

    def pick(q: float) -> float:
        return ms[min(len(ms) - 1, int(round(q * (len(ms) - 1))))]

    return {"mean": statistics.mean(ms), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99),
            "max": ms[-1], "std": statistics.pstdev(ms)}


def plot(results: dict[str, dict], path: Path, window_s: float = 12.0) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pols = list(results)
    fig, axes = plt.subplots(len(pols) + 1, 1, figsize=(13, 2.1 * len(pols) + 3.2),
                             gridspec_kw={"height_ratios": [1] * len(pols) + [1.3]})
    colors = {0: "tab:blue", 1: "tab:orange"}
    for ax, pol in zip(axes, pols):
        r = results[pol]["analysis"]
        # a steady-state window: from the middle of the run
        mid = r["wall_s"] * 0.4
        for st in r["stages"]:
            for k, (a, b) in enumerate(st["intervals"]):
                if b >= mid and a <= mid + window_s:     # clipped to the window
                    lo, hi = max(a, mid), min(b, mid + window_s)
                    ax.broken_barh([(lo - mid, hi - lo)], (st["stage"] - 0.4, 0.8),
                                   color=colors[k % 2], edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(r["stages"])), [f"stage {s}" for s in range(len(r["stages"]))])
        ax.invert_yaxis()
        ax.set_xlim(0, window_s)
        ax.set_title(f"{pol}: bubble fraction {r['bubble_fraction']:.1%} "
                     f"(stage idle / wall; iteration-time CV {r['iteration_time_cv']:.2f})", fontsize=10)
    axes[len(pols) - 1].set_xlabel("seconds (a window mid-run; alternate colours = consecutive micro-batches)")
    ax = axes[-1]
    data = [[x for x in _busy_ms(results[p]["analysis"], 0)] for p in pols]
    ax.boxplot(data, orientation="horizontal", tick_labels=pols, showfliers=True)
    ax.set_xscale("log")
    ax.set_xlabel("stage-0 busy time per micro-batch (ms, log): iteration-time variance per policy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _busy_ms(r: dict, stage: int) -> list[float]:
    return [(b - a) * 1000 for a, b in r["stages"][stage]["intervals"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="sarathi,vllm,orca")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--qps", type=float, default=4.0, help="Poisson arrival rate (requests/s)")
    ap.add_argument("--scale", type=float, default=8.0, help="divide the trace's lengths by this")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                    help="CSV of request lengths (default: the ShareGPT-4 length trace of sarathi.measure)")
    ap.add_argument("--token-budget", type=int, default=256, help="tau (sarathi)")
    ap.add_argument("--max-batched-tokens", type=int, default=2048, help="vllm / orca batch cap")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--pp-layers", default="", help="layers per stage, e.g. 16,14 (default: balanced)")
    ap.add_argument("--tag", default="", help="suffix of the per-policy JSON names")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/bubbles/pipeline_bubbles")
    ap.add_argument("--plot", action="store_true", help="merge the per-policy JSONs into one JSON + PNG")
    args = ap.parse_args()
    out = Path(args.out)
    if args.plot:
        results = {p: json.loads(Path(f"{out}_{p}{args.tag}.json").read_text()) for p in args.policies.split(",")
                   if Path(f"{out}_{p}{args.tag}.json").exists()}
        out = Path(f"{out}{args.tag}")
        plot(results, out.with_suffix(".png"))
        keys = ("bubble_fraction", "iteration_time_cv", "wall_s", "iterations", "saturated")
        summary = {p: {k: r["analysis"][k] for k in keys}
                   | {"stages": [{k: v for k, v in st.items() if k != "intervals"} for st in r["analysis"]["stages"]]}
                   | {k: r[k] for k in ("command", "date", "machine", "loadavg", "config", "scheduler_stats")}
                   for p, r in results.items()}
        out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
        print(json.dumps({p: (s["bubble_fraction"], s["iteration_time_cv"]) for p, s in summary.items()}))
        return
    reqs = workload(args.requests, args.scale, args.qps, args.seed, 2048, args.trace)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "replica.log"
        proc, remote = start_replica(tmp, args.pp, args.num_blocks, args.model, log, args.pp_layers)
        try:
            for pol in args.policies.split(","):
                load0 = Path("/proc/loadavg").read_text().split()[:3]
                print(f"{pol}: {len(reqs)} requests at {args.qps}/s", file=sys.stderr, flush=True)
                t = time.monotonic()
                trace, stats = drive(remote, pol, reqs, args)
                r = analyse(trace, args.pp)
                r["saturated"] = {k: v for k, v in analyse(trace, args.pp, saturated=True).items()
                                  if k not in ("batch_tokens", "batch_kind")}
                for st in r["saturated"]["stages"]:
                    st.pop("intervals")
                print(f"{pol}: {time.monotonic() - t:.0f}s, bubble fraction {r['bubble_fraction']:.3f} "
                      f"(saturated window {r['saturated']['bubble_fraction']:.3f}), iteration CV "
                      f"{r['iteration_time_cv']:.2f}", file=sys.stderr, flush=True)
                Path(f"{out}_{pol}{args.tag}.json").write_text(json.dumps({
                    "policy": pol, "command": "python -m bench.pipeline_bubbles " + shlex.join(sys.argv[1:]),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "machine": machine(), "loadavg": [load0, Path("/proc/loadavg").read_text().split()[:3]],
                    "workload": {"requests": args.requests, "qps": args.qps, "scale": args.scale,
                                 "prompt_tokens": [p for _, p, _ in reqs], "decode_tokens": [d for _, _, d in reqs]},
                    "config": {k: getattr(args, k) for k in ("token_budget", "max_batched_tokens", "max_num_seqs",
                                                             "pp", "pp_layers")},
                    "scheduler_stats": stats, "analysis": r,
                    "trace": [{k: e[k] for k in ("batch_id", "num_tokens", "waiting", "submitted_at", "collected_at")}
                              | {k: v for k, v in e["timings"].items() if k.startswith("rank")}
                              for e in trace]}, indent=None))
        finally:
            remote.close()
            proc.terminate()
            proc.wait(20)


if __name__ == "__main__":
    main()
