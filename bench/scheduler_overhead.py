"""Scheduler overhead: wall time of one schedule() call with N running requests.

The scheduler runs on the CPU between GPU iterations, so its cost adds to every TBT sample.
Each measurement brings N requests (prompt_len-token prompts) to the decode phase with the
torch-free SimExecutor, then times schedule() (and, separately, update()) over `iters`
decode iterations in which nobody finishes. Goal: median under 1 ms at 256 running.

    python -m bench.scheduler_overhead [--sizes 32 256 1024] [--policies sarathi ...]
        [--iters 300] [--prompt-len 512] [--gc-off] [--out bench/results/scheduler/scheduler_overhead.json]
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from bench.common import machine_line
from scheduler_svc.sim_executor import sim_engine
from shared.sampling import SamplingParams


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def warm_engine(policy: str, n: int, prompt_len: int, iters: int):
    """An engine with n running requests, all decoding, each with > iters tokens to go."""
    max_tokens = iters + n * prompt_len // 512 + 100  # outlives the warm-up: nobody finishes
    ctx = prompt_len + max_tokens
    blocks_each = -(-ctx // 16) + 1
    loop = sim_engine(policy, token_budget=n + 512, max_num_seqs=n, block_size=16,
                      num_blocks=n * blocks_each + 16, max_model_len=ctx,
                      max_num_batched_tokens=max(8192, prompt_len), verify_kv=False,
                      clock=time.monotonic)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(n):
        loop.add_request(f"r{i}", [1 + (i + j) % 30000 for j in range(prompt_len)], sp)
    while not all(r.is_decode for r in loop.scheduler.running) or loop.scheduler.waiting:
        loop.step()
    return loop


def time_iterations(sched, ex, n: int, iters: int) -> tuple[list[float], list[float]]:
    """Seconds spent in schedule() and in update() for each of `iters` decode iterations."""
    sched_s, update_s = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        out = ex.execute(batch)
        t2 = time.perf_counter()
        sched.update(batch, out)
        t3 = time.perf_counter()
        assert len(batch.seqs) == n, "every running request decodes in every iteration"
        sched_s.append(t1 - t0)
        update_s.append(t3 - t2)
    return sched_s, update_s


def measure(policy: str, n: int, prompt_len: int, iters: int, gc_off: bool = False) -> dict:
    """gc_off: disable Python's cyclic GC during the timed loop, to separate GC pauses (which
    dominate the p99 at 1024) from the scheduler's own work."""
    loop = warm_engine(policy, n, prompt_len, iters)
    gc.collect()
    if gc_off:
        gc.disable()
    try:
        sched_s, update_s = time_iterations(loop.scheduler, loop.executor, n, iters)
    finally:
        gc.enable()
    ms = lambda xs, q: round(percentile(xs, q) * 1e3, 4)  # noqa: E731
    return {"policy": policy, "running": n, "iters": iters, "gc": "off" if gc_off else "on",
            "schedule_median_ms": ms(sched_s, 0.5), "schedule_p99_ms": ms(sched_s, 0.99),
            "schedule_mean_ms": round(statistics.fmean(sched_s) * 1e3, 4),
            "update_median_ms": ms(update_s, 0.5), "update_p99_ms": ms(update_s, 0.99)}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, policy in enumerate(dict.fromkeys(r["policy"] for r in results)):
        rs = [r for r in results if r["policy"] == policy]
        xs, color = [r["running"] for r in rs], f"C{i}"
        ax.plot(xs, [r["schedule_median_ms"] for r in rs], "o-", color=color,
                label=f"{policy} median")
        ax.plot(xs, [r["schedule_p99_ms"] for r in rs], "x--", color=color, alpha=0.5,
                label=f"{policy} p99")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":", label="1 ms goal")
    ax.set(xscale="log", yscale="log", xlabel="running requests",
           ylabel="schedule() time per iteration (ms)", title="Scheduler overhead")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 256, 1024])
    ap.add_argument("--policies", nargs="+", default=["sarathi"])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--out", type=Path, default=Path("bench/results/scheduler/scheduler_overhead.json"))
    ap.add_argument("--gc-off", action="store_true", help="disable the cyclic GC while timing")
    ap.add_argument("--note", default="")
    a = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    results = []
    for policy in a.policies:
        for n in a.sizes:
            results.append(measure(policy, n, a.prompt_len, a.iters, a.gc_off))
            print(json.dumps(results[-1]), flush=True)
    report = {"command": shlex.join(["python", "-m", "bench.scheduler_overhead",
                                      *(argv or sys.argv[1:])]),
              "machine": machine_line(), "python": platform.python_version(),
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "load_avg_1min_before_after": [load_before, os.getloadavg()[0]],
              "prompt_len": a.prompt_len, "note": a.note, "results": results}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(results, a.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
