"""Does the order engine processes start in show in their speed? An A/A run: N processes with the
same settings (SmolLM2's GGUF, this machine's defaults or the environment's), started one after
another, stepped in turn (ABBA) as the comparison benchmarks step their arms; the medians by start
position. Any difference is the harness's, not the code's: the reason the comparisons run two
sessions of opposite start order (bench.common.start_order_sessions).

    python -m bench.start_order [--processes 3] [--rounds 9] [--out bench/results/kernels/start_order]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from bench.common import EngineProcess
from bench.gguf_kernels import cpu_id, pressure

CASES = {"decode:1": 9, "prefill:128": 2}   # case -> timed consecutive steps a round (after one)


def run(processes: int, rounds: int, threads: int) -> dict:
    tree = Path(__file__).resolve().parent.parent
    procs = [EngineProcess(tree, threads, "float32:auto:auto") for _ in range(processes)]
    times = [{c: [] for c in CASES} for _ in procs]
    for r in range(rounds):
        for i in (range(processes) if r % 2 == 0 else reversed(range(processes))):
            for c, steps in CASES.items():
                ts = [procs[i].step(c)["s"] for _ in range(steps + 1)][1:]
                times[i][c].append(statistics.median(ts))
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{1e3 * t['decode:1'][-1]:.2f}" for t in times),
              file=sys.stderr, flush=True)
    backend = procs[0].info["ready"]
    for p in procs:
        p.close()
    ms = [{c: round(1e3 * statistics.median(v), 2) for c, v in t.items()} for t in times]
    last = times[-1]
    paired = [{c: round(statistics.median(a / b for a, b in zip(t[c], last[c])), 3) for c in CASES} for t in times]
    return {"ms_by_start_position": ms, "paired_ratio_to_last_started": paired, "backend": backend,
            "rounds_ms": [{c: [round(1e3 * x, 2) for x in v] for c, v in t.items()} for t in times]}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CASES), figsize=(9, 3.6))
    for ax, c in zip(axes, CASES):
        vals = [m[c] for m in res["ms_by_start_position"]]
        ax.bar(range(1, len(vals) + 1), vals, color="C0")
        for i, v in enumerate(vals):
            ax.text(i + 1, v, f"{res['paired_ratio_to_last_started'][i][c]:.3f}x", ha="center", va="bottom",
                    fontsize=8)
        ax.set_xlabel("start position (same settings in every process)")
        ax.set_ylabel("ms a step")
        ax.set_title(c)
    fig.suptitle(f"A/A: {res['machine']}, {res['threads']} threads, {res['date'][:16]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/kernels/start_order"))
    a = ap.parse_args(argv)
    res = {"command": "python -m bench.start_order " + " ".join(sys.argv[1:] if argv is None else argv),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": cpu_id(), "threads": a.threads, "pressure_before": pressure()}
    res.update(run(a.processes, a.rounds, a.threads))
    res["pressure_after"] = pressure()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    plot(res, a.out.with_suffix(".png"))
    print(json.dumps({k: res[k] for k in ("ms_by_start_position", "paired_ratio_to_last_started")}, indent=1))


if __name__ == "__main__":
    main()
