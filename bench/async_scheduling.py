"""Async scheduling over HTTP: two `sarathi serve` with the same flags, one with
`--async-scheduling`, under the same bursts of streamed requests, arms in turn.

What it measures: the time between tokens a client sees while every request decodes together
(a burst of `c` requests that arrive at once, the same prompt length, EOS ignored, so every
iteration after the prefills is a decode batch of c sequences), and the output tokens per second
of the burst. Without async scheduling the worker waits, between two iterations, for the
scheduler to take the tokens back, plan the next batch and send it; with it the next batch is
already there. The difference is that wait, per iteration.

    python -m bench.async_scheduling OUT [--concurrency 1,4,16] [--prompt-len 128]
        [--max-tokens 128] [--reps 4] [--threads 1] [--base-tree DIR]

--base-tree DIR adds a third server, arm "base": `sarathi serve` without async scheduling run
from another checkout (e.g. `git worktree add DIR <commit>`, with the built kernels copied in),
so a change to the synchronous path is measured in the same run; the arms rotate per repetition.

Each (concurrency, repetition) runs both arms, in turn, ABBA (every other repetition
reversed); a warm-up burst per server first. Per run: the client-side summary
(sarathi.measure.metrics.summarize). The report: per concurrency, the median over repetitions of
each arm's TBT P50, P99 and output tokens/s, and the median of the per-repetition ratios
(async / off). Writes OUT.json and OUT.png. Start it from the repository root.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import free_port, machine
from bench.speculation_load import VOCAB, Server, log_path, warm
from sarathi.measure.env import command_line
from sarathi.measure.loadgen import RequestSpec, run_http
from sarathi.measure.metrics import json_safe, summarize
from shared.model_source import default_gguf_path

ARMS = ("off", "async")
BASE = "base"


def serve_cmd(gguf: str, port: int, arm: str, threads: int, token_budget: str) -> list[str]:
    cmd = [sys.executable, "-m", "sarathi.cli", "serve", "--model", gguf, "--threads", str(threads),
           "--token-budget", token_budget, "--host", "127.0.0.1", "--port", str(port)]
    return cmd + (["--async-scheduling"] if arm == "async" else [])


def burst(c: int, prompt_len: int, max_tokens: int, seed: int) -> list[RequestSpec]:
    """c requests arriving together: distinct token-id prompts of prompt_len tokens."""
    rng = np.random.default_rng(seed)
    return [RequestSpec(f"b{i}", 0.0, rng.integers(1, VOCAB, prompt_len).tolist(), max_tokens)
            for i in range(c)]


def run(a) -> dict:
    gguf = str(default_gguf_path())
    out = Path(a.out)
    servers: dict[str, Server] = {}
    runs = []
    arms = ARMS + ((BASE,) if a.base_tree else ())
    try:
        for arm in arms:
            port = free_port()
            cwd = a.base_tree if arm == BASE else None
            servers[arm] = Server(f"sarathi-{arm}", serve_cmd(gguf, port, arm, a.threads, a.token_budget),
                                  port, log_path(out, arm), gguf, cwd=cwd)
        for s in servers.values():
            s.wait_ready()
        for s in servers.values():
            warm(s.url, burst(1, a.prompt_len, 16, a.seed + 999)[0].prompt_ids)
            run_http(s.url, burst(max(a.concurrency), a.prompt_len, 32, a.seed + 1000), drain_s=120.0)
        total = len(a.concurrency) * a.reps * len(arms)
        for c in a.concurrency:
            for rep in range(a.reps):
                workload = burst(c, a.prompt_len, a.max_tokens, a.seed + rep)
                order = arms[rep % len(arms):] + arms[:rep % len(arms)]    # rotated per repetition
                for arm in (order if rep % 2 == 0 else order[::-1]):
                    load0 = os.getloadavg()[0]
                    started = time.strftime("%H:%M:%S", time.gmtime())
                    res = run_http(servers[arm].url, workload, drain_s=a.drain)
                    summ = summarize(res.records, end_time=res.end_time)
                    runs.append({"concurrency": c, "rep": rep, "arm": arm, "started_utc": started,
                                 "loadavg_1m_start": load0, "summary": summ})
                    print(f"[{len(runs)}/{total}] c {c:3d} rep {rep} {arm:5s}: TBT p50 "
                          f"{summ['tbt_p50_s'] * 1e3:7.2f} ms p99 {summ['tbt_p99_s'] * 1e3:7.2f} ms, "
                          f"{summ['output_tok_per_s']:7.1f} tok/s, finished {summ['finished']}/{summ['requests']}",
                          flush=True)
    finally:
        for s in servers.values():
            s.stop()
    command = command_line(prog="python -m bench.async_scheduling")
    if a.base_tree:      # recorded by its commit, not by where it sits on this machine
        command = command.replace(a.base_tree, f"<checkout of {_describe_tree(a.base_tree)}>")
    return {"command": command, "machine": machine(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "concurrency": a.concurrency, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
            "reps": a.reps, "threads": a.threads, "token_budget": a.token_budget, "seed": a.seed,
            "base_tree": None if not a.base_tree else _describe_tree(a.base_tree),
            "servers": {arm: s.recorded for arm, s in servers.items()}, "runs": runs,
            "report": report(runs, a.concurrency, a.reps, arms)}


def _describe_tree(path: str) -> str:
    """The base checkout as recorded: its commit, not its path on this machine."""
    import subprocess
    commit = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return f"commit {commit or '?'}"


def report(runs: list[dict], concurrency: list[int], reps: int, arms=ARMS) -> list[dict]:
    """Per concurrency: each arm's median, and the medians of the per-repetition ratios async /
    off (ratio_*) and, with a base arm, off / base (base_ratio_*)."""
    rows = []
    for c in concurrency:
        row: dict = {"concurrency": c}
        by = {(r["arm"], r["rep"]): r["summary"] for r in runs if r["concurrency"] == c}
        for key in ("tbt_p50_s", "tbt_p99_s", "output_tok_per_s"):
            for arm in arms:
                vals = [by[(arm, i)][key] for i in range(reps) if (arm, i) in by]
                row[f"{arm}_{key}"] = statistics.median(vals) if vals else None
            for name, num, den in (("ratio", "async", "off"), ("base_ratio", "off", BASE)):
                if den not in arms:
                    continue
                ratios = [by[(num, i)][key] / by[(den, i)][key] for i in range(reps)
                          if (num, i) in by and (den, i) in by and by[(den, i)][key]]
                row[f"{name}_{key}"] = statistics.median(ratios) if ratios else None
                row[f"{name}s_{key}"] = ratios
        rows.append(row)
    return rows


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["report"]
    cs = [r["concurrency"] for r in rows]
    x = np.arange(len(cs))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, key, label, scale in ((axes[0], "tbt_p50_s", "TBT P50 (ms)", 1e3),
                                  (axes[1], "tbt_p99_s", "TBT P99 (ms)", 1e3),
                                  (axes[2], "output_tok_per_s", "output tokens/s", 1.0)):
        arms = [arm for arm in (BASE,) + ARMS if f"{arm}_{key}" in rows[0]]
        width = 0.8 / len(arms)
        for k, arm in enumerate(arms):
            vals = [(r[f"{arm}_{key}"] or 0) * scale for r in rows]
            name = {"async": "async scheduling", "off": "off", BASE: f"off, {doc.get('base_tree')}"}[arm]
            bars = ax.bar(x + (k - (len(arms) - 1) / 2) * width, vals, width, label=name)
            if arm == "async":
                for b, r in zip(bars, rows):
                    if r[f"ratio_{key}"]:
                        ax.annotate(f"{r[f'ratio_{key}']:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [str(c) for c in cs])
        ax.set_xlabel("concurrent streams (one burst)")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    m = doc["machine"]
    fig.suptitle(f"sarathi serve with and without --async-scheduling: SmolLM2-135M GGUF, prompt "
                 f"{doc['prompt_len']}, {doc['max_tokens']} tokens each, {doc['threads']} worker thread(s)\n"
                 f"{m['cpu']} ({m['cpus']} CPUs), {doc['date']}; median of {doc['reps']} ABBA repetitions, "
                 "labels: median per-repetition ratio async / off", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.async_scheduling", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output path without extension (writes OUT.json, OUT.png)")
    p.add_argument("--concurrency", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="the worker's torch threads")
    p.add_argument("--token-budget", default="512")
    p.add_argument("--drain", type=float, default=300.0, help="seconds to wait for a burst to finish")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-tree", default=None, help="another checkout: a third server from it (see above)")
    a = p.parse_args(argv)
    doc = run(a)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(json_safe(doc), indent=1))
    plot(doc, out.with_suffix(".png"))
    for r in doc["report"]:
        base = (f"; off / base {r['base_ratio_tbt_p50_s']:.3f} (base {r['base_tbt_p50_s'] * 1e3:.2f} ms)"
                if "base_ratio_tbt_p50_s" in r else "")
        print(f"c {r['concurrency']:3d}: TBT p50 off {r['off_tbt_p50_s'] * 1e3:.2f} async "
              f"{r['async_tbt_p50_s'] * 1e3:.2f} ms (ratio {r['ratio_tbt_p50_s']:.3f}); tok/s ratio "
              f"{r['ratio_output_tok_per_s']:.3f}{base}")


if __name__ == "__main__":
    main()
