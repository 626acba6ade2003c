"""A/B of the fused native CPU ops (issue 11): one decode step of SmolLM2-135M with the layers'
glue on the torch reference (SARATHI_NATIVE_OPS=0: RMSNorm, rotary, silu * up, KV write as
torch ops) vs on csrc/cpu_ops.c. Both executors are the CPU defaults otherwise (fp32 compute,
int8 weights, bf16 KV, native decode attention) and live in one process; steps alternate
A, B, A, B, ... so load drifts hit both alike. Also records the executor's own per-step
timings (prepare = batch checks + metadata, sample) for the after variant.

    taskset -c 1 python -m bench.cpu_fused_ops [--threads 1] [--reps 30] [--out bench/results/cpu_fused_ops_amd]

Writes OUT.json (per case: median/min ms per step of each variant, the ratio, all samples)
and OUT.png.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch

import bench.engine_iteration as ei


def build(native_ops: bool):
    os.environ["SARATHI_NATIVE_OPS"] = "1" if native_ops else "0"
    try:
        return ei.make_executor("float32:auto:auto:auto")
    finally:
        del os.environ["SARATHI_NATIVE_OPS"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cases", default="decode:1,decode:32")
    ap.add_argument("--out", default="bench/results/cpu_fused_ops_amd")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ei.DECODE_SIZES, ei.PREFILL_SIZES = [32], [512]
    ei.NUM_BLOCKS = 32 * (ei.CONTEXT // ei.BLOCK_SIZE + 1) + 512 // ei.BLOCK_SIZE
    exs = {"torch_ops": build(False), "native_ops": build(True)}
    assert exs["native_ops"].backend.ops.name != "torch", exs["native_ops"].backend.describe()
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    res = {}
    for case in args.cases.split(","):
        series, n = case.split(":")
        batch = ei.make_batch(series, int(n))
        for ex in exs.values():
            for _ in range(3):
                ex.execute(batch)
        ts = {v: [] for v in exs}
        parts = []
        for _ in range(args.reps):
            for v, ex in exs.items():
                t0 = time.perf_counter()
                out = ex.execute(batch)
                ts[v].append(time.perf_counter() - t0)
                if v == "native_ops":
                    parts.append(out.timings)
        r = {v: {"median_ms": round(statistics.median(x) * 1e3, 3), "min_ms": round(min(x) * 1e3, 3),
                 "samples_ms": [round(s * 1e3, 3) for s in x]} for v, x in ts.items()}
        r["speedup_median"] = round(r["torch_ops"]["median_ms"] / r["native_ops"]["median_ms"], 3)
        r["saved_ms_median"] = round(r["torch_ops"]["median_ms"] - r["native_ops"]["median_ms"], 3)
        r["native_ops_executor_ms"] = {k: round(statistics.median(p[k] for p in parts) * 1e3, 3)
                                       for k in ("prepare_s", "forward_s", "sample_s")}
        res[case] = r
        print(case, {v: r[v]["median_ms"] for v in exs}, "speedup", r["speedup_median"], flush=True)
    result = {"command": "python -m bench.cpu_fused_ops " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": ei.machine(), "threads": args.threads, "context": ei.CONTEXT,
              "backends": {v: ex.backend.describe() for v, ex in exs.items()},
              "loadavg_before_after": [load_before, Path("/proc/loadavg").read_text().split()[:3]],
              "results": res}
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, Path(args.out).with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(result["results"])
    fig, axes = plt.subplots(1, len(cases), figsize=(4.5 * len(cases), 4))
    for ax, case in zip(axes if len(cases) > 1 else [axes], cases):
        r = result["results"][case]
        vs = ["torch_ops", "native_ops"]
        ax.bar(vs, [r[v]["median_ms"] for v in vs], color=["tab:gray", "tab:blue"])
        for i, v in enumerate(vs):
            ax.scatter([i] * len(r[v]["samples_ms"]), r[v]["samples_ms"], s=6, color="k", zorder=3)
        ax.set(title=f"{case.replace('decode:', 'decode@1k batch ')}: {r['speedup_median']}x",
               ylabel="step time (ms), median + samples")
    fig.suptitle(f"{result['machine'][:48]}, {result['threads']} thread(s), {result['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
