"""The installed kernel variants against a build here, and the AVX2 variant's two arithmetics,
on SmolLM2's real GGUF, one engine process per arm, stepped in turn (ABBA), llama.cpp's
llama-bench between rounds when built.

Arms (ARMS): the prebuilt variant this CPU gets and a -march=native build of the same sources
(the question: does a portable instruction-set level cost speed?); the prebuilt avx2 variant with
its default before (8-token tile kernels up to GGUF_MAX_TOKENS, the float GEMM on a cached fp32
copy above) and with the lane kernels at every call (one arithmetic at every batch size, no fp32
copy), and an AVX2 build here (-march=znver3) with the lanes, against which the avx2 variant is
compared where no AVX2-only machine is at hand; and the installed variant with the row-lane
kernel's 16-row path from 5 tokens (the threshold measured on Xeons) instead of its default on
this CPU; and the installed variant with Q8_0's calls of 1-4 tokens through the weight pairs
(AVX2 builds: the code before the row dots; SmolLM2's LM head is Q8_0). Cases: decode 1 and 32
at 1k context, prefill 512 (the default), and prompts of 1-16 tokens (`prefill:N`: one call of N
tokens through every layer, the shape of a decode verifying N - 1 drafts). Each arm's resident
memory after its last step.

    python -m bench.kernel_variants [--rounds 7] [--threads 2] [--no-llama] [--llama-isa avx2]
                                    [--arms A,B] [--cases decode:1,prefill:4]
                                    [--out bench/results/kernels/variants_zen4]

`avx2-only` with `--llama-isa avx2` is the AVX2 comparison where no AVX2-only machine is at hand:
both engines at AVX2 + FMA on whatever x86 CPU runs it (ours: the avx2 variant, torch's kernels
held to AVX2; llama.cpp: its AVX2 build).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

from bench.common import EngineProcess, start_order_sessions
from bench.gguf_kernels import ENGINE_CASES as CASES
from bench.gguf_kernels import LLAMA, LLAMA_CMDS, STEPS, cpu_id, pressure, rss_mb, step_in_turn

SMALL_PREFILL_STEPS = 8   # timed consecutive steps a round of a prefill:N case, N <= 16 (as decode 1)

# key: (what it is, its environment)
ARMS = {
    "best": ("prebuilt best variant", {"SARATHI_NATIVE_BUILD": "prebuilt"}),
    "native": ("built here -march=native", {"SARATHI_NATIVE_BUILD": "jit"}),
    "avx2-tiles": ("prebuilt avx2: tiles <= 48 tokens, fp32 GEMM above", {"SARATHI_NATIVE_VARIANT": "avx2",
                                                                          "SARATHI_GGUF_LANES": "0"}),
    "avx2-lanes": ("prebuilt avx2: lane kernels at every T", {"SARATHI_NATIVE_VARIANT": "avx2",
                                                               "SARATHI_GGUF_LANES": "1"}),
    "znver3-lanes": ("built here -march=znver3: lanes at every T", {"SARATHI_NATIVE_MARCH": "znver3",
                                                                     "SARATHI_GGUF_LANES": "1"}),
    # what an AVX2-only machine runs, on a newer one: the avx2 variant (lanes, its default) and
    # torch's own kernels held to AVX2 too (ATen's dispatch, oneDNN, MKL)
    "avx2-only": ("prebuilt avx2 + torch held to AVX2 (an AVX2 machine's engine)",
                  {"SARATHI_NATIVE_VARIANT": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                   "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
    "rows16-from5": ("prebuilt best, 16-row kernel from 5 tokens (the Xeon threshold)",
                     {"SARATHI_NATIVE_BUILD": "prebuilt", "SARATHI_GGUF_ROWS16_MIN": "5"}),
    "q8-pairs": ("prebuilt best, Q8_0 at 1-4 tokens through the weight pairs (AVX2: the code before its row dots)",
                 {"SARATHI_NATIVE_BUILD": "prebuilt", "SARATHI_GGUF_Q8_ROWDOT": "0"}),
}
# the ratios the results README reports: (numerator arm, denominator arm)
RATIOS = {
    "prebuilt_over_native": ("best", "native"),
    "avx2_prebuilt_over_znver3_build": ("avx2-lanes", "znver3-lanes"),
    "avx2_lanes_over_tiles": ("avx2-lanes", "avx2-tiles"),
    "avx2_lanes_over_llama": ("avx2-lanes", LLAMA),
    "avx2_tiles_over_llama": ("avx2-tiles", LLAMA),
    "best_over_llama": ("best", LLAMA),
    "avx2_only_over_llama": ("avx2-only", LLAMA),
    "best_over_rows16_from5": ("best", "rows16-from5"),
    "best_over_q8_pairs": ("best", "q8-pairs"),
}


def parse_cases(text: str) -> list[str]:
    """--cases: comma-separated of the engine cases (decode:1, decode:32, prefill:512) and
    prefill:N for 1 <= N <= 16; raises ValueError naming what it refuses."""
    cases = [c for c in text.split(",") if c]
    for c in cases:
        kind, _, n = c.partition(":")
        if c not in CASES and not (kind == "prefill" and n.isdigit() and 1 <= int(n) <= 16):
            raise ValueError(f"unknown case {c!r}: choose from {', '.join(CASES)} or prefill:N with N in 1..16")
    if not cases:
        raise ValueError("--cases names no case")
    return cases


def run(rounds: int, threads: int, llama: bool, arms: list[str], cases: list[str] = CASES) -> dict:
    """The arms stepped in turn on `cases`, in two sessions of opposite start order
    (start_order_sessions)."""
    for c in cases:
        STEPS.setdefault(c, SMALL_PREFILL_STEPS)
    tree = Path(__file__).resolve().parent.parent
    times: dict | None = None
    backends, rss, done = {}, {}, 0
    for order, n in start_order_sessions(arms, rounds):
        procs = {}
        for name in order:
            print(f"starting {name} ...", file=sys.stderr, flush=True)
            procs[name] = EngineProcess(tree, threads, "float32:auto:auto", env=ARMS[name][1])

        def progress(r: int, t: dict) -> None:
            print(f"round {done + r + 1}/{rounds}: " + "; ".join(
                f"{a} " + "/".join(f"{1e3 * t[a][c][-1]:.2f}" for c in cases if t[a].get(c)) + " ms"
                for a in t if any(t[a].values())), file=sys.stderr, flush=True)

        t = step_in_turn(procs, cases, n, threads, llama, on_round=progress)
        times = t if times is None else {a: {c: times[a][c] + t[a][c] for c in t[a]} for a in t}
        done += n
        backends.update({name: p.info["ready"] for name, p in procs.items()})
        rss.update({name: round(rss_mb(p.proc.pid), 1) for name, p in procs.items()})
        for p in procs.values():
            p.close()
    arms_info = {n: {"what": ARMS[n][0], "env": ARMS[n][1]} for n in arms}
    return {**summarize(times, cases), "cases": cases, "rss_MB": rss, "backends": backends, "arms": arms_info,
            "llama_bench_commands": dict(LLAMA_CMDS) if llama else {}}


def summarize(times: dict, cases: list[str] = CASES) -> dict:
    """times: arm (or LLAMA) -> case -> seconds per round. Medians in ms, the RATIOS of medians,
    the same ratios round by round (both arms of a round ran minutes apart at most: their median
    and range, the statistic to read where the machine's speed drifts between rounds), and every
    round in ms."""
    ms = {n: {c: round(1e3 * statistics.median(ts), 2) for c, ts in d.items() if ts} for n, d in times.items()}
    ratios = {k: {c: round(ms[a][c] / ms[b][c], 3) for c in cases if c in ms.get(a, {}) and c in ms.get(b, {})}
              for k, (a, b) in RATIOS.items() if a in ms and b in ms}
    paired = {k: {c: paired_ratio(times[a][c], times[b][c]) for c in cases if times[a].get(c) and times[b].get(c)}
              for k, (a, b) in RATIOS.items() if a in times and b in times}
    rounds_ms = {n: {c: [round(1e3 * t, 2) for t in ts] for c, ts in d.items() if ts} for n, d in times.items()}
    return {"ms": ms, "ratios": ratios, "paired_ratios": paired, "rounds_ms": rounds_ms}


def paired_ratio(a: list[float], b: list[float]) -> dict:
    """Per-round ratios a[i] / b[i]: their median, min, max and how many rounds a was slower."""
    r = [x / y for x, y in zip(a, b)]
    return {"median": round(statistics.median(r), 3), "min": round(min(r), 3), "max": round(max(r), 3),
            "rounds_above_1": sum(x > 1 for x in r), "rounds": len(r)}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["ms"])
    cases = res.get("cases", CASES)
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4.5), squeeze=False)
    for ax, c in zip(axes[0], cases):
        vals = [res["ms"][n].get(c, 0) for n in names]
        ax.barh(range(len(names)), vals, color=["C0", "C1", "C2", "C3", "C4", "C7"][:len(names)])
        ax.set_yticks(range(len(names)))
        labels = [res["arms"][n]["what"] if n in res["arms"] else n for n in names]
        ax.set_yticklabels(labels if c == cases[0] else [""] * len(names), fontsize=8)
        ax.set_title(f"{c} (ms, lower is better)")
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.1f}", va="center", fontsize=8)
    fig.suptitle(f"{res['machine']}, {res['threads']} threads, {res['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--llama-isa", choices=("native", "avx2"), default="native",
                    help="which llama.cpp build to run: -march=native, or its AVX2 level "
                         "(LLAMA_ISA=avx2 bench/build_llama_server.sh builds it)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms of {', '.join(ARMS)} (default: all)")
    ap.add_argument("--cases", default=",".join(CASES),
                    help="comma-separated, of decode:1, decode:32, prefill:512 and prefill:N (N in 1..16); "
                         "llama-bench runs only with the default cases")
    ap.add_argument("--out", default="bench/results/kernels/variants")
    a = ap.parse_args(argv)
    try:
        cases = parse_cases(a.cases)
    except ValueError as e:
        ap.error(str(e))
    arms = [n for n in a.arms.split(",") if n]
    unknown = [n for n in arms if n not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    res = {"command": "python -m bench.kernel_variants " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": cpu_id(), "threads": a.threads, "rounds": a.rounds, "pressure_before": pressure()}
    if a.llama_isa == "avx2":
        os.environ["SARATHI_LLAMA_ISA"] = "avx2"     # read by bench.gguf_kernels.llama_bench_once
    llama = not a.no_llama and set(CASES) <= set(cases)   # llama-bench times the default cases
    res["llama_isa"] = a.llama_isa if llama else None
    res.update(run(a.rounds, a.threads, llama, arms, cases))
    res["pressure_after"] = pressure()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out.with_suffix(".png"))
    print(json.dumps({"ms": res["ms"], "ratios": res["ratios"], "paired_ratios": res["paired_ratios"],
                      "rss_MB": res["rss_MB"]}, indent=2))


if __name__ == "__main__":
    main()
