"""A/B(/C) of the fused native CPU ops and the per-step Python trims: one decode step
of SmolLM2-135M at 1k context, CPU defaults (fp32 compute, int8 weights, bf16 KV, native decode
attention), in up to three variants, each in its own process (pinned like this driver):

* base: the engine of another source tree (--base-tree, e.g. `git archive <commit>` of the
  commit before this work), as it was;
* torch_ops: this tree with SARATHI_NATIVE_OPS=0 (the layers' glue on the torch reference:
  RMSNorm, rotary, silu * up, KV write as torch ops; the Python trims included);
* native_ops: this tree as shipped (csrc/cpu_ops.c).

The driver asks the variants for one step each in turn, A, B, C, A, B, C, ..., so load drifts
hit all alike (the machine is shared); a step's time is measured inside its process around
ModelRunner.execute. Also records each variant's executor timings (prepare, forward, sample).

    taskset -c 1 python -m bench.cpu_fused_ops [--threads 1] [--reps 30] [--base-tree DIR]
        [--out bench/results/engine_cpu/cpu_fused_ops_amd]

Writes OUT.json (per case and variant: median/min ms, samples; ratios to base) and OUT.png.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

from bench.common import EngineProcess


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cases", default="decode:1,decode:32")
    ap.add_argument("--base-tree", default="", help="source tree of the 'base' variant (omit: no base)")
    ap.add_argument("--out", default="bench/results/engine_cpu/cpu_fused_ops_amd")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    specs = ([("base", Path(args.base_tree).resolve(), {})] if args.base_tree else []) + [
        ("torch_ops", here, {"SARATHI_NATIVE_OPS": "0"}), ("native_ops", here, {"SARATHI_NATIVE_OPS": "1"})]
    procs = {name: EngineProcess(tree, args.threads, env=env) for name, tree, env in specs}
    info = {name: p.info for name, p in procs.items()}
    assert "ops native" in info["native_ops"]["ready"], info
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    res = {}
    for case in args.cases.split(","):
        for p in procs.values():
            for _ in range(3):
                p.step(case)
        got = {v: [] for v in procs}
        for _ in range(args.reps):
            for v, p in procs.items():
                got[v].append(p.step(case))
        r = {}
        for v, xs in got.items():
            r[v] = {"median_ms": round(statistics.median(x["s"] for x in xs) * 1e3, 3),
                    "min_ms": round(min(x["s"] for x in xs) * 1e3, 3),
                    "executor_median_ms": {k: round(statistics.median(x[k] for x in xs) * 1e3, 3)
                                           for k in ("prepare_s", "forward_s", "sample_s")},
                    "samples_ms": [round(x["s"] * 1e3, 3) for x in xs]}
        ref = "base" if "base" in r else "torch_ops"
        for v in r:
            r[v][f"speedup_vs_{ref}"] = round(r[ref]["median_ms"] / r[v]["median_ms"], 3)
        res[case] = r
        print(case, {v: (r[v]["median_ms"], r[v][f"speedup_vs_{ref}"]) for v in r}, flush=True)
    for p in procs.values():
        p.close()
    result = {"command": "python -m bench.cpu_fused_ops " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                     for k, v in vars(args).items()),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": info["native_ops"]["machine"], "threads": args.threads, "context": 1024,
              "backends": {v: i["ready"] for v, i in info.items()},
              "base_tree": args.base_tree or None,
              "loadavg_before_after": [load_before, Path("/proc/loadavg").read_text().split()[:3]],
              "results": res}
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, Path(args.out).with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(result["results"])
    fig, axes = plt.subplots(1, len(cases), figsize=(4.8 * len(cases), 4.2))
    colors = {"base": "tab:gray", "torch_ops": "tab:orange", "native_ops": "tab:blue"}
    for ax, case in zip(axes if len(cases) > 1 else [axes], cases):
        r = result["results"][case]
        vs = list(r)
        ax.bar(vs, [r[v]["median_ms"] for v in vs], color=[colors[v] for v in vs])
        for i, v in enumerate(vs):
            ax.scatter([i] * len(r[v]["samples_ms"]), r[v]["samples_ms"], s=5, color="k", zorder=3)
            sp = [x for k, x in r[v].items() if k.startswith("speedup_vs_")][0]
            ax.annotate(f"{r[v]['median_ms']:.1f} ms\n{sp}x", (i, 0.04 * r[v]["median_ms"]), ha="center",
                        va="bottom", fontsize=9, color="white", weight="bold")
        ax.set(title=case.replace("decode:", "decode @1k, batch "), ylabel="step time (ms): median, samples")
    fig.suptitle(f"{result['machine'][:48]}, {result['threads']} thread(s), {result['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
