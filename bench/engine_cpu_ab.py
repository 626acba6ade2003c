"""Quick A/B of the CPU engine before/after issue 11 on the issue's target cases, each next to
its bandwidth bound (bench.engine_iteration.step_bytes / bench.membw read bandwidth).

before = fp32 weights, fp32 KV (the native kernel's new AVX2 path; the old build ran its scalar
path on AVX2-only CPUs); after = the CPU defaults (bf16 KV, int8 weights for <= 64 tokens).
Per case: one warm-up, then `reps` interleaved before/after executions; medians and minima.
Results print as they come (a partial run still says something).

    python -m bench.engine_cpu_ab THREADS OUT   (e.g. 1 bench/results/engine_cpu_amd_contended_1t)
"""
from __future__ import annotations

import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import bench.engine_iteration as ei


def main() -> None:
    threads, out = int(sys.argv[1]), Path(sys.argv[2])
    ei.DECODE_SIZES, ei.PREFILL_SIZES = [1, 32], [512]
    ei.NUM_BLOCKS = 32 * (ei.CONTEXT // ei.BLOCK_SIZE + 1) + 512 // ei.BLOCK_SIZE
    torch.set_num_threads(threads)
    exs = {"before": ei.make_executor("float32:float32:none:auto"),
           "after": ei.make_executor("float32:auto:auto:auto")}
    bw = json.loads(Path("bench/results/membw_amd.json").read_text())["results"][f"{threads}t"]["read_gb_per_s"]
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    res = {}
    for s, n in [("decode", 1), ("decode", 32), ("decode_short", 32), ("decode_short", 1), ("prefill", 512)]:
        batch = ei.make_batch(s, n)
        for ex in exs.values():
            ex.execute(batch)
        ts = {v: [] for v in exs}
        for _ in range(2 if s == "prefill" else 5):
            for v, ex in exs.items():
                t0 = time.perf_counter()
                ex.execute(batch)
                ts[v].append(time.perf_counter() - t0)
        for v, ex in exs.items():
            med, nbytes = statistics.median(ts[v]), ei.step_bytes(ex, s, n)
            bound = nbytes / (bw * 1e9)
            res[f"{v} {s}:{n}"] = {"median_ms": round(med * 1e3, 2), "min_ms": round(min(ts[v]) * 1e3, 2),
                                   "bytes": nbytes, "bound_ms": round(bound * 1e3, 2),
                                   "x_bound": round(med / bound, 2),
                                   "samples_ms": [round(x * 1e3, 2) for x in ts[v]]}
            print(v, s, n, res[f"{v} {s}:{n}"], flush=True)
    result = {"command": f"python -m bench.engine_cpu_ab {threads} {out}",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": ei.machine(), "threads": threads, "membw_read_gb_per_s": bw,
              "backends": {v: ex.backend.describe() for v, ex in exs.items()},
              "loadavg_before_after": [load_before, Path("/proc/loadavg").read_text().split()[:3]],
              "results": res}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k.split(" ", 1)[1] for k in result["results"]}, key=list(
        k.split(" ", 1)[1] for k in result["results"]).index)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, v in enumerate(("before", "after")):
        xs = [j + (i - 0.5) * 0.38 for j in range(len(keys))]
        r = [result["results"][f"{v} {k}"] for k in keys]
        ax.bar(xs, [p["median_ms"] for p in r], 0.38, label=f"{v}: {result['backends'][v]}")
        ax.scatter(xs, [p["bound_ms"] for p in r], marker="_", s=250, color="k", zorder=3,
                   label="bound: bytes / read bandwidth" if i == 0 else None)
    ax.set_xticks(range(len(keys)), [k.replace("decode_short", "decode@128").replace("decode:", "decode@1k:")
                                     for k in keys])
    ax.set(yscale="log", ylabel="step time (ms)",
           title=f"{result['machine'][:40]}, {result['threads']} thread(s), load {result['loadavg_before_after'][0][0]}")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
