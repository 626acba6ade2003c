"""Where a CPU engine step's time goes: torch.profiler over ModelRunner.execute on the issue-11
cases (decode batch 1 and 32 at 1k context), the CPU defaults (int8 weights, bf16 KV).

    python -m bench.engine_profile [--threads 2] [--reps 10] [--out bench/results/engine_cpu/engine_profile_amd]

Writes OUT.json (per case: wall ms per step, and the ops by self CPU time per step) and OUT.txt
(torch's own table). Self CPU time per op includes the op's Python-side dispatch, so the sum
over ops vs the wall time shows what is neither (Python between ops).
"""
from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import SMALL, machine_line, make_batch, make_executor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--variant", default="float32:auto:auto:auto")
    ap.add_argument("--cases", default="decode:1,decode:32")
    ap.add_argument("--out", default="bench/results/engine_cpu/engine_profile")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
    ex = make_executor(args.variant, SMALL)
    out, text = {}, []
    for series, n in cases:
        batch = make_batch(series, n, SMALL)
        for _ in range(3):
            ex.execute(batch)
        t0 = time.perf_counter()
        for _ in range(args.reps):
            ex.execute(batch)
        wall = (time.perf_counter() - t0) / args.reps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.reps):
                ex.execute(batch)
        ka = prof.key_averages()
        ops = sorted(({"op": e.key, "calls_per_step": e.count / args.reps,
                       "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / args.reps, 3)}
                      for e in ka), key=lambda r: -r["self_ms_per_step"])
        out[f"{series}:{n}"] = {"wall_ms": round(wall * 1e3, 2),
                                "sum_self_ms": round(sum(r["self_ms_per_step"] for r in ops), 2),
                                "ops": ops[:40]}
        text.append(f"== {series}:{n}  wall {wall * 1e3:.1f} ms/step (unprofiled), {args.reps} steps profiled\n")
        text.append(ka.table(sort_by="self_cpu_time_total", row_limit=30))
        print(text[-2] + text[-1], flush=True)
    res = {"command": "python -m bench.engine_profile " + " ".join(
               f"--{k} {v}" for k, v in vars(args).items()),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_line(), "backend": ex.backend.describe(),
           "loadavg": Path("/proc/loadavg").read_text().split()[:3], "cases": out}
    Path(args.out).with_suffix(".json").write_text(json.dumps(res, indent=1))
    Path(args.out).with_suffix(".txt").write_text("".join(text))


if __name__ == "__main__":
    main()
