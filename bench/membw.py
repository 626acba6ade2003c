"""STREAM-like memory read bandwidth of this machine: the denominator of every "bound" in the
engine benchmarks (a decode step cannot run faster than its bytes / this bandwidth).

Read test: torch.sum over a float32 array much larger than the last-level cache (each byte read
once per pass; torch's reduction is vectorised and split over the threads). Also a copy test
(read + write, counted as 2x the array bytes, as STREAM does). Median of the passes.

    python -m bench.membw [--mb 1024] [--passes 7] [--threads 1,2] [--out bench/results/engine_cpu/membw_amd.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def read_gb_per_s(mb: int, passes: int, threads: int) -> tuple[float, list[float]]:
    torch.set_num_threads(threads)
    x = torch.ones(mb * (1 << 20) // 4, dtype=torch.float32)
    x.sum()                                           # first touch already done by ones(); warm
    ts = []
    for _ in range(passes):
        t0 = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t0)
    rates = [x.numel() * 4 / t / 1e9 for t in ts]
    return statistics.median(rates), rates


def copy_gb_per_s(mb: int, passes: int, threads: int) -> float:
    torch.set_num_threads(threads)
    x = torch.ones(mb * (1 << 20) // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    y.copy_(x)
    ts = []
    for _ in range(passes):
        t0 = time.perf_counter()
        y.copy_(x)
        ts.append(time.perf_counter() - t0)
    return 2 * x.numel() * 4 / statistics.median(ts) / 1e9


def main(argv: list[str] | None = None) -> dict:
    from bench.common import machine_line

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=1024, help="array size (MB); >> the L3 cache")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", default="bench/results/engine_cpu/membw_amd.json")
    args = ap.parse_args(argv)
    results = {}
    for t in (int(s) for s in args.threads.split(",")):
        med, rates = read_gb_per_s(args.mb, args.passes, t)
        results[f"{t}t"] = {"read_gb_per_s": round(med, 2), "read_samples": [round(r, 2) for r in rates],
                            "copy_gb_per_s": round(copy_gb_per_s(args.mb, args.passes, t), 2)}
        print(f"{t} threads: read {med:.1f} GB/s, copy {results[f'{t}t']['copy_gb_per_s']:.1f} GB/s",
              file=sys.stderr)
    out = {"command": "python -m bench.membw " + " ".join(sys.argv[1:] if argv is None else argv),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_line(), "loadavg": Path("/proc/loadavg").read_text().split()[:3],
           "array_mb": args.mb, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(results))
    return out


if __name__ == "__main__":
    main()
