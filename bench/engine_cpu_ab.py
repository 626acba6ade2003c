"""Quick A/B of the CPU engine: fp32 against the defaults, or two source trees, case by case,
each next to its bandwidth bound (bench.common.step_bytes / bench.membw read bandwidth).

before = fp32 weights, fp32 KV; after = the CPU defaults (bf16 KV, int8 weights for small
batches, fp32 GEMM above); int8-bf16 = the opt-in `--weight-quant int8-bf16` (bf16 GEMM above).
Per case: one warm-up, then `reps` interleaved before/after executions; medians and minima.
Results print as they come (a partial run still says something).

    python -m bench.engine_cpu_ab THREADS OUT [MEMBW_JSON]   (e.g. 2 bench/results/engine_cpu/engine_cpu_zen4_2t
                                                              bench/results/engine_cpu/membw_zen4.json)
    python -m bench.engine_cpu_ab THREADS OUT [REPS] --base-tree DIR [--cases decode:32,prefill:512]
        (this tree against another, e.g. `git worktree add ../base <commit>`: fp32 and the
        defaults, four interleaved processes; see tree_ab)

MEMBW_JSON: the read bandwidth of this machine (python -m bench.membw --out ...), default
bench/results/engine_cpu/membw_amd.json (Zen 3). When llama.cpp's llama-bench is built
(bench/build_llama_server.sh) it runs in the same hold on the same GGUF (`-p 512 -n 128 -t
THREADS`) and its decode step and 512-token prefill sit beside the engine's.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import SMALL, EngineProcess, machine_line, make_batch, make_executor, step_bytes

CASES = [("decode", 1), ("decode", 32), ("decode_short", 32), ("decode_short", 1), ("prefill", 512)]
# engine settings compared across trees: the float path (exact against Hugging Face) and the defaults
TREE_SPECS = {"fp32": "float32:float32:none:auto", "defaults": "float32:auto:auto:auto"}


def main() -> None:
    if "--base-tree" in sys.argv:
        i = sys.argv.index("--base-tree")
        base, rest = Path(sys.argv[i + 1]), sys.argv[1:i] + sys.argv[i + 2:]
        cases = CASES
        if "--cases" in rest:     # e.g. --cases decode:32,prefill:512 to re-measure an outlier
            j = rest.index("--cases")
            cases = [(c.split(":")[0], int(c.split(":")[1])) for c in rest[j + 1].split(",")]
            rest = rest[:j] + rest[j + 2:]
        tree_ab(int(rest[0]), Path(rest[1]), base, int(rest[2]) if len(rest) > 2 else 10, cases)
        return
    threads, out = int(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(threads)
    exs = {"before": make_executor("float32:float32:none:auto", SMALL),
           "after": make_executor("float32:auto:auto:auto", SMALL),
           # opt-in: bf16 GEMM above the int8 threshold (not batch-invariant; worker_svc/backends/cpu/quant.py)
           "int8-bf16": make_executor("float32:auto:int8-bf16:auto", SMALL)}
    membw = Path(sys.argv[3] if len(sys.argv) > 3 else "bench/results/engine_cpu/membw_amd.json")
    bw = json.loads(membw.read_text())["results"][f"{threads}t"]["read_gb_per_s"]
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    res = {}
    for s, n in CASES:
        batch = make_batch(s, n, SMALL)
        for ex in exs.values():
            ex.execute(batch)
        ts = {v: [] for v in exs}
        for _ in range(2 if s == "prefill" else 5):
            for v, ex in exs.items():
                t0 = time.perf_counter()
                ex.execute(batch)
                ts[v].append(time.perf_counter() - t0)
        for v, ex in exs.items():
            med, nbytes = statistics.median(ts[v]), step_bytes(ex, s, n)
            bound = nbytes / (bw * 1e9)
            res[f"{v} {s}:{n}"] = {"median_ms": round(med * 1e3, 2), "min_ms": round(min(ts[v]) * 1e3, 2),
                                   "bytes": nbytes, "bound_ms": round(bound * 1e3, 2),
                                   "x_bound": round(med / bound, 2),
                                   "samples_ms": [round(x * 1e3, 2) for x in ts[v]]}
            print(v, s, n, res[f"{v} {s}:{n}"], flush=True)
    llama = llama_bench(threads)
    result = {"command": "python -m bench.engine_cpu_ab " + " ".join(sys.argv[1:]), "membw_file": str(membw),
              "llama_bench": llama,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_line(), "threads": threads, "membw_read_gb_per_s": bw,
              "backends": {v: ex.backend.describe() for v, ex in exs.items()},
              "loadavg_before_after": [load_before, Path("/proc/loadavg").read_text().split()[:3]],
              "results": res}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))


def tree_ab(threads: int, out: Path, base: Path, reps: int, cases=CASES) -> None:
    """The engine of another source tree (`base`, e.g. `git worktree add DIR <commit>`) against this
    one, for each of TREE_SPECS: four processes (base/this x fp32/defaults), asked for one step
    each in turn, the order reversed every round, `reps` rounds per case (prefill: a third of
    them) after two warm-up steps, so load drifts and cache effects hit all alike. Writes OUT.json
    (medians, minima, samples, this/base median ratios with a 95% bootstrap interval) and OUT.png."""
    here = Path(__file__).resolve().parent.parent
    procs = {f"{tree} {name}": EngineProcess(path, threads, spec)
             for tree, path in (("base", base.resolve()), ("this", here)) for name, spec in TREE_SPECS.items()}
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    res = {}
    for s, n in cases:
        case = f"{s}:{n}"
        for p in procs.values():
            for _ in range(2):
                p.step(case)
        ts = {v: [] for v in procs}
        order = list(procs)
        for _ in range(max(2, reps // 3) if s == "prefill" else reps):
            for v in order:
                ts[v].append(procs[v].step(case)["s"])
            order.reverse()   # ABCD DCBA ...: no variant always runs right after the same one
        r = {v: {"median_ms": round(statistics.median(x) * 1e3, 2), "min_ms": round(min(x) * 1e3, 2),
                 "samples_ms": [round(t * 1e3, 2) for t in x]} for v, x in ts.items()}
        for name in TREE_SPECS:
            this, base_ = ts[f"this {name}"], ts[f"base {name}"]
            r[f"this {name}"]["this_over_base"] = round(statistics.median(this) / statistics.median(base_), 3)
            r[f"this {name}"]["this_over_base_ci95"] = ratio_ci(this, base_)
        res[case] = r
        print(case, {v: (x["median_ms"], x.get("this_over_base"), x.get("this_over_base_ci95"))
                     for v, x in r.items()}, flush=True)
    info = {v: p.info for v, p in procs.items()}
    for p in procs.values():
        p.close()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=base, capture_output=True, text=True)
    result = {"command": "python -m bench.engine_cpu_ab " + " ".join(sys.argv[1:]).replace(str(base), "BASE"),
              "base_tree": {"name": base.name, "commit": rev.stdout.strip() or None},
              "this_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                                            capture_output=True, text=True).stdout.strip(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": info["this defaults"]["machine"], "threads": threads, "reps": reps,
              "backends": {v: i["ready"] for v, i in info.items()},
              "loadavg_before_after": [load_before, Path("/proc/loadavg").read_text().split()[:3]],
              "results": res}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot_tree_ab(result, out.with_suffix(".png"))


def ratio_ci(this: list[float], base: list[float], rounds: int = 4000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of median(this) / median(base): resample each side's steps with
    replacement. A ratio whose interval holds 1 is no measurable difference on this machine."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a, b = np.asarray(this), np.asarray(base)
    ratios = (np.median(rng.choice(a, (rounds, a.size)), axis=1)
              / np.median(rng.choice(b, (rounds, b.size)), axis=1))
    return [round(float(x), 3) for x in np.percentile(ratios, [2.5, 97.5])]


def plot_tree_ab(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(result["results"])
    fig, axes = plt.subplots(1, len(TREE_SPECS), figsize=(6 * len(TREE_SPECS), 4.5))
    for ax, name in zip(axes, TREE_SPECS):
        for i, (tree, color) in enumerate((("base", "tab:gray"), ("this", "tab:blue"))):
            xs = [j + (i - 0.5) * 0.38 for j in range(len(cases))]
            r = [result["results"][c][f"{tree} {name}"] for c in cases]
            ax.bar(xs, [x["median_ms"] for x in r], 0.38, color=color,
                   label=f"{tree} ({result['base_tree']['commit'] if tree == 'base' else result['this_commit']})")
            for x, p in zip(xs, r):
                ax.scatter([x] * len(p["samples_ms"]), p["samples_ms"], s=4, color="k", zorder=3)
        for j, c in enumerate(cases):
            r = result["results"][c][f"this {name}"]
            lo, hi = r["this_over_base_ci95"]
            top = max(max(result["results"][c][v]["samples_ms"]) for v in (f"base {name}", f"this {name}"))
            ax.annotate(f"{r['this_over_base']:.2f}x\n[{lo:.2f}, {hi:.2f}]", (j, top * 1.1),   # above the samples
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(cases)), [c.replace("decode_short", "decode@128").replace("decode:", "decode@1k:")
                                          for c in cases], fontsize=8)
        every = [t for c in cases for v in ("base", "this") for t in result["results"][c][f"{v} {name}"]["samples_ms"]]
        ax.set_ylim(min(every) * 0.7, max(every) * 3)     # room for the labels above the samples
        ax.set(yscale="log", ylabel="step time (ms): median, samples",
               title=f"{name}: this / base (median ratio, 95% bootstrap interval)")
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.suptitle(f"{result['machine'][:48]}, {result['threads']} thread(s), {result['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def llama_bench(threads: int) -> dict | None:
    """llama.cpp's own benchmark on the default GGUF (Q4_1): prefill 512 and 128 decode steps,
    as ms per 512-token prefill and ms per decode step; None when llama-bench is not built."""
    from shared.model_source import default_gguf_path

    binary = Path(os.environ.get("SARATHI_PEER_CACHE", Path.home() / ".cache/sarathi-peer")) / \
        "build-11434.0.0/bin/llama-bench"
    if not binary.exists():
        print(f"llama-bench not built ({binary}): bench/build_llama_server.sh builds it", file=sys.stderr)
        return None
    cmd = [str(binary), "-m", str(default_gguf_path()), "-p", "512", "-n", "128", "-t", str(threads),
           "-r", "3", "-o", "json"]
    runs = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout)
    # recorded without this machine's paths: the binary under ~, the GGUF by name
    shown = [str(binary).replace(str(Path.home()), "~", 1), "-m", default_gguf_path().name, *cmd[3:]]
    res = {"command": " ".join(shown)}
    for r in runs:
        kind = "prefill:512" if r["n_prompt"] else "decode:1 (tg128)"
        res[kind] = {"tokens_per_s": round(r["avg_ts"], 2),
                     "ms": round((512 if r["n_prompt"] else 1) * 1e3 / r["avg_ts"], 2),
                     "model_type": r.get("model_type"), "build": r.get("build_commit")}
    print("llama-bench", res, flush=True)
    return res


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k.split(" ", 1)[1] for k in result["results"]}, key=list(
        k.split(" ", 1)[1] for k in result["results"]).index)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    variants = list(result["backends"])
    w = 0.8 / len(variants)
    for i, v in enumerate(variants):
        xs = [j + (i - (len(variants) - 1) / 2) * w for j in range(len(keys))]
        r = [result["results"][f"{v} {k}"] for k in keys]
        ax.bar(xs, [p["median_ms"] for p in r], w, label=f"{v}: {result['backends'][v]}")
        ax.scatter(xs, [p["bound_ms"] for p in r], marker="_", s=250, color="k", zorder=3,
                   label="bound: bytes / read bandwidth" if i == 0 else None)
    llama = result.get("llama_bench") or {}
    for j, k in enumerate(keys):
        # tg128 decodes from an empty context: closest to the engine's decode at 128 tokens
        lk = "decode:1 (tg128)" if k == "decode_short:1" else k
        if lk in llama:
            ax.scatter([j], [llama[lk]["ms"]], marker="*", s=120, color="tab:red", zorder=4,
                       label="llama.cpp (llama-bench, Q4_1)" if k == "decode_short:1" else None)
    ax.set_xticks(range(len(keys)), [k.replace("decode_short", "decode@128").replace("decode:", "decode@1k:")
                                     for k in keys])
    ax.set(yscale="log", ylabel="step time (ms)",
           title=f"{result['machine'][:40]}, {result['threads']} thread(s), "
                 f"load {result['loadavg_before_after'][0][0]}")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
