"""Iteration time of the real engine (SmolLM2-135M, CPU) by batch shape: the CPU version of the
Sarathi-Serve paper's Figures 3, 4, 6 and 9.

Series (all through ModelRunner.execute, so prepare + forward + sampling are included):
* decode:  B decodes of 1 token each at a 1k-token context (B = 1 .. 128); decode_short: the
  same at a 128-token context, where the linear layers dominate;
* prefill: one prompt chunk of N tokens with an empty prefix (N = 1 .. 2048): where the linear
  layers turn from flat (weight-bandwidth bound) to linear (compute bound) in N;
* hybrid:  32 decodes at 1k context + one chunk of N tokens: what a chunk adds to a decode batch.

A variant is a dtype and a torch thread count. Each round runs every case once, all variants
of a case back to back (interleaved A/B), and the median over rounds is reported, so
background load hits all variants alike. The KV cache holds
zeros: attention cost depends on lengths, not on values.

    python -m bench.engine_iteration [--rounds 5] [--threads 1,2] [--dtypes float32,bfloat16]
writes bench/results/engine_cpu/engine_iteration.json and .png.

--variants NAME=DTYPE:KV:WEIGHTS:ATTENTION,... replaces --dtypes with engine configurations
(KV: kv_cache_dtype, WEIGHTS: weight_quant, ATTENTION: auto|torch), e.g. the issue-11 run
`--variants before=float32:float32:none:auto,after=float32:auto:auto:auto`; with --membw
<json of bench.membw> every case also gets its bound: bytes the step must read (weights as
the variant stores them for that token count, plus the KV cache it attends over) / bandwidth.
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

from bench.common import (
    CONTEXT,
    FULL,
    HYBRID_DECODES,
    SHORT_CONTEXT,
    SMALL,
    Layout,
    machine_line,
    make_batch,
    make_executor,
    step_bytes,
)
from worker_svc.model_runner import ModelRunner

DECODE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
PREFILL_SIZES = [1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048]
HYBRID_SIZES = [16, 32, 64, 128, 256, 512, 1024]
TARGETS = {"decode_b1_s": 0.040, "decode_b32_tok_per_s": 500.0, "prefill_512_s": 0.3}
PROFILE_CASES = [("decode", 1), ("decode", 32), ("decode_short", 32), ("prefill", 512)]


def cases(decode_sizes=DECODE_SIZES, prefill_sizes=PREFILL_SIZES, hybrid_sizes=HYBRID_SIZES
          ) -> list[tuple[str, int]]:
    return ([("decode", b) for b in decode_sizes] + [("decode_short", b) for b in decode_sizes]
            + [("prefill", n) for n in prefill_sizes]
            + [("hybrid", n) for n in hybrid_sizes])


def measure(executors: dict[str, ModelRunner], threads: list[int], rounds: int,
            case_list: list[tuple[str, int]], layout: Layout) -> tuple[dict, dict]:
    """(wall, cpu): variant ("float32/2t") -> "series:size" -> seconds per round. cpu is the
    process CPU time of the iteration: with 1 thread it is what the run costs without being
    descheduled by other load (spinning OpenMP threads inflate it with 2)."""
    variants = {f"{d}/{t}t": (ex, t) for d, ex in executors.items() for t in threads}
    wall = {v: {f"{s}:{n}": [] for s, n in case_list} for v in variants}
    cpu = {v: {f"{s}:{n}": [] for s, n in case_list} for v in variants}
    batches = {(s, n): make_batch(s, n, layout) for s, n in case_list}
    for ex in executors.values():                  # warm-up: first-touch of the cache pages
        for key in batches:
            ex.execute(batches[key])
    for r in range(rounds):
        for (s, n), batch in batches.items():      # case-major: variants of a case run back to back
            for v, (ex, t) in variants.items():
                torch.set_num_threads(t)
                t0, c0 = time.perf_counter(), time.process_time()
                ex.execute(batch)
                wall[v][f"{s}:{n}"].append(time.perf_counter() - t0)
                cpu[v][f"{s}:{n}"].append(time.process_time() - c0)
        print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return wall, cpu


def summarize(wall: dict, cpu: dict) -> dict:
    out = {}
    for variant, by_case in wall.items():
        out[variant] = {}
        for key, ts in by_case.items():
            series, size = key.split(":")
            tokens = int(size) + (HYBRID_DECODES if series == "hybrid" else 0)
            med = statistics.median(ts)
            out[variant].setdefault(series, []).append(
                {"size": int(size), "tokens": tokens, "median_s": med, "min_s": min(ts),
                 "tokens_per_s": tokens / med, "median_cpu_s": statistics.median(cpu[variant][key]),
                 "samples_s": [round(t, 5) for t in ts]})
    return out


def against_targets(summary: dict) -> dict:
    def at(variant, series, size):
        return next(p for p in summary[variant][series] if p["size"] == size)
    measured = {v: {"decode_b1_s": at(v, "decode", 1)["median_s"],
                    "decode_b32_tok_per_s": at(v, "decode", 32)["tokens_per_s"],
                    f"decode_b32_ctx{SHORT_CONTEXT}_tok_per_s": at(v, "decode_short", 32)["tokens_per_s"],
                    "prefill_512_s": at(v, "prefill", 512)["median_s"]} for v in summary}
    return {"targets": TARGETS, "measured": measured}


def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    titles = {"decode": f"decode-only batch (context {CONTEXT}; x: {SHORT_CONTEXT})", "prefill": "prefill chunk alone",
              "hybrid": f"{HYBRID_DECODES} decodes + prefill chunk"}
    xlabels = {"decode": "decodes in batch", "prefill": "chunk tokens", "hybrid": "chunk tokens"}
    for ax, series in zip(axes, titles):
        for variant, by_series in summary.items():
            pts = by_series[series]
            line, = ax.plot([p["size"] for p in pts], [p["median_s"] * 1e3 for p in pts], "o-",
                            label=variant)
            if series == "decode":
                short = by_series["decode_short"]
                ax.plot([p["size"] for p in short], [p["median_s"] * 1e3 for p in short], "x--",
                        color=line.get_color(), label=f"{variant}, context {SHORT_CONTEXT}")
            if series == "hybrid":
                base = next(p for p in by_series["decode"] if p["size"] == HYBRID_DECODES)
                ax.axhline(base["median_s"] * 1e3, ls=":", lw=1, color=line.get_color(),
                           label=f"{variant}: {HYBRID_DECODES} decodes alone")
        ax.set(xscale="log", yscale="log", title=titles[series], xlabel=xlabels[series],
               ylabel="iteration time (ms, median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_bounds(summary: dict, path: Path) -> None:
    """Bars: median step time per case and variant; a black tick at each bar's bandwidth bound."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(summary)
    keys = [(s, p["size"]) for s in summary[variants[0]] for p in summary[variants[0]][s]]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(keys)), 4.8))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        pts = {(s, p["size"]): p for s in summary[v] for p in summary[v][s]}
        xs = [k + (i - (len(variants) - 1) / 2) * width for k in range(len(keys))]
        ax.bar(xs, [pts[k]["median_s"] * 1e3 for k in keys], width, label=v)
        if "bound_s" in pts[keys[0]]:
            ax.scatter(xs, [pts[k]["bound_s"] * 1e3 for k in keys], marker="_", s=300, color="k",
                       zorder=3, label="bound (bytes / read bandwidth)" if i == 0 else None)
    names = {"decode": f"ctx {CONTEXT}", "decode_short": f"ctx {SHORT_CONTEXT}", "prefill": "prefill",
             "hybrid": f"{HYBRID_DECODES} dec + chunk"}
    ax.set_xticks(range(len(keys)), [f"{names.get(s, s)}\n{n}" for s, n in keys])
    ax.set(yscale="log", ylabel="step time (ms, median)", title="engine step vs its memory bound")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def profile(executors: dict[str, ModelRunner], threads: int, path: Path, layout: Layout) -> None:
    """torch.profiler tables (ops by self CPU time) of the cases the targets are about."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.set_num_threads(threads)
    parts = [f"# python -m bench.engine_iteration --profile --threads {threads}  ({machine_line()}, "
             f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, "
             f"loadavg {Path('/proc/loadavg').read_text().split()[:3]})\n"
             "# self CPU time is wall time of each op on this thread: other load inflates it\n"]
    for dtype, ex in executors.items():
        for series, size in PROFILE_CASES:
            batch = make_batch(series, size, layout)
            ex.execute(batch)
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    ex.execute(batch)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
            parts.append(f"## {dtype} {series} {size} (3 iterations)\n{table}\n")
    path.write_text("\n".join(parts))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1,2", help="torch thread counts to compare, e.g. 1,2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default="bench/results/engine_cpu/engine_iteration")
    ap.add_argument("--note", default="", help="free text stored with the results (e.g. machine load)")
    ap.add_argument("--targets-only", action="store_true",
                    help="only the target cases: decode batch 1 and 32, prefill 512, 32 decodes + a 512 chunk")
    ap.add_argument("--variants", default="", help="NAME=DTYPE:KV:WEIGHTS:ATTENTION,... (see module doc)")
    ap.add_argument("--membw", default="", help="bench.membw JSON: add each case's bandwidth bound")
    ap.add_argument("--profile", action="store_true",
                    help="instead of the sweep, write torch.profiler tables to <out>_profile.txt")
    args = ap.parse_args(argv)
    if args.targets_only:   # a cache for 32 sequences, not 128: 1.6 GB of fp32 KV per executor, not 6.2 GB
        case_list, layout = cases([1, 32], [512], [512]), SMALL
    else:
        case_list, layout = cases(), FULL
    if args.variants:
        executors = {name: make_executor(spec, layout) for name, spec in
                     (v.split("=", 1) for v in args.variants.split(","))}
    else:
        executors = {d: make_executor(d, layout) for d in args.dtypes.split(",")}
    for name, ex in executors.items():
        print(f"{name}: {ex.backend.describe()}", file=sys.stderr)
    if args.profile:
        threads = int(args.threads.split(",")[-1])
        profile(executors, threads, Path(f"{args.out}_profile_{threads}t.txt"), layout)
        return
    threads = [int(t) for t in args.threads.split(",")]
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    summary = summarize(*measure(executors, threads, args.rounds, case_list, layout))
    if args.membw:
        bw = json.loads(Path(args.membw).read_text())["results"]
        for variant, by_series in summary.items():
            name, t = variant.rsplit("/", 1)
            gbps = bw.get(t, bw[max(bw)])["read_gb_per_s"]
            for series, pts in by_series.items():
                for p in pts:
                    p["bytes"] = step_bytes(executors[name], series, p["size"])
                    p["bound_s"] = p["bytes"] / (gbps * 1e9)
                    p["x_bound"] = round(p["median_s"] / p["bound_s"], 2)
    result = {
        "command": "python -m bench.engine_iteration " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_line(), "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        "loadavg_before_after": [load_before, Path("/proc/loadavg").read_text().split()[:3]],
        "note": args.note, "rounds": args.rounds, "context_tokens": CONTEXT,
        "backends": {name: ex.backend.describe() for name, ex in executors.items()},
        "membw": json.loads(Path(args.membw).read_text()) if args.membw else None,
        "vs_targets": against_targets(summary), "results": summary,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(summary, out.with_suffix(".png"))
    if args.membw:
        plot_bounds(summary, out.parent / (out.name + "_bounds.png"))
    print(json.dumps(result["vs_targets"], indent=1))


if __name__ == "__main__":
    main()
