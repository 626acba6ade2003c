"""Goodput and capacity of colocated, disaggregated and conditional (auto) serving, on this machine.

Three deployments of the same model on the same machine, with the same worker count, threads
per worker and KV blocks per worker, each a real `sarathi serve` stack driven over HTTP:

* colocated: `--workers 2` (two mixed workers, stall-free chunked prefills on both);
* disagg:    `--prefill-workers 1 --decode-workers 1 --disaggregation all`;
* auto:      `--prefill-workers 1 --decode-workers 1 --disaggregation auto` (threshold 256 tokens,
             backlog margin 2048 tokens: the defaults);
* auto-tbt:  the same with the threshold and margin a strict TBT SLO asks for (32 tokens: what
             fits one SLO-compliant iteration beside the decodes; no backlog fallback).

Two workloads: (a) the ShareGPT length trace scaled as in bench/results/paper (x0.125), (b) a
long-prompt workload (outputs uniform in [16, 48] tokens, prompts 8-16x their output). Every
(deployment, workload, rate) is ONE open-loop Poisson run; all SLO pairs are evaluated on the
same runs, so a cell costs no extra machine time.

Definitions (per run; unfinished requests are misses):
* a request meets an SLO pair (TTFT s, TBT s) when its TTFT <= TTFT SLO and its mean time
  between tokens (DistServe's TPOT) <= TBT SLO;
* goodput (DistServe): the highest tested rate at which >= 90% of requests meet the pair, all
  lower tested rates passing too (so one lucky run does not count), plus the rate where the
  attainment curve crosses 90% by linear interpolation between the last passing and the first
  failing rate;
* capacity (the paper): the highest tested rate at which P99 TBT over all tokens <= TBT SLO
  (scheduling delay is not visible over HTTP).

Runs are saved one by one (`<out>_runs.json`); a rerun with the same output skips the runs it
already has, so an interrupted sweep resumes. `report` recomputes the tables and plots from the
runs without running anything.

    python -m bench.disagg_goodput run --out bench/results/disagg/goodput
    python -m bench.disagg_goodput report --out bench/results/disagg/goodput
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench.common import free_port, machine
from sarathi.measure.loadgen import make_workload, run_http
from sarathi.measure.metrics import RequestRecord, json_safe, percentile, summarize
from sarathi.measure.trace import Trace, load_trace

DEPLOYMENTS = {
    "colocated": ["--workers", "2"],
    "disagg": ["--prefill-workers", "1", "--decode-workers", "1", "--disaggregation", "all"],
    "auto": ["--prefill-workers", "1", "--decode-workers", "1", "--disaggregation", "auto"],
    # auto as planned for a strict TBT SLO: a prompt colocated on the decode worker must fit one
    # iteration within the SLO (~32 tokens here), and a prefill backlog never sends prompts back
    "auto-tbt": ["--prefill-workers", "1", "--decode-workers", "1", "--disaggregation", "auto",
                 "--disagg-threshold", "32", "--disagg-backlog-margin", "100000"],
}
ATTAINMENT = 0.9
VOCAB = 49152   # SmolLM2's; prompts are random ids in [100, VOCAB)


def workloads(max_total_len: int = 2048) -> dict[str, Trace]:
    """sharegpt: the paper's trace x0.125 (bench/results/paper); long: prompts 8-16x outputs."""
    rng = np.random.default_rng(1)
    out = rng.integers(16, 49, 4000)
    prompt = np.minimum(np.round(out * rng.uniform(8, 16, out.size)).astype(int), max_total_len - 48)
    return {"sharegpt": load_trace(length_scale=0.125, max_total_len=1024),
            "long": Trace(prompt.tolist(), out.tolist(), "synthetic: output U[16,48], prompt 8-16x output")}


def parse_slos(specs: list[str]) -> dict[str, tuple[float, float]]:
    """NAME=TTFT_S,TBT_S (seconds) -> {NAME: (ttft, tbt)}."""
    out = {}
    for s in specs:
        m = re.fullmatch(r"([\w-]+)=([\d.]+),([\d.]+)", s)
        if not m:
            raise SystemExit(f"--slo {s!r}: expected NAME=TTFT_SECONDS,TBT_SECONDS")
        out[m[1]] = (float(m[2]), float(m[3]))
    return out


# -- the stacks ----------------------------------------------------------------------------------

def _get(url: str, timeout: float = 2.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()
    except OSError:
        return None


class Stack:
    """`sarathi serve` with a deployment's flags, on a free port, until close()."""

    def __init__(self, name: str, common: list[str], log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "sarathi", "serve", "--port", str(self.port), *common,
                    *DEPLOYMENTS[name]]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(log_dir / f"{name}.log", "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 300
        while _get(self.url + "/ready") is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name}: sarathi serve exited ({self.proc.returncode}); "
                                   f"see {self.log.name}")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{name}: not ready after 300 s; see {self.log.name}")
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        """Every sample of the gateway's /metrics (embedded mode shows the scheduler's too)."""
        text = _get(self.url + "/metrics", timeout=10) or ""
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                try:
                    out[key] = float(value)
                except ValueError:
                    pass
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _metric_delta(before: dict, after: dict, pattern: str) -> dict[str, float]:
    """Counters/histogram sums and counts matching pattern: after - before."""
    rx = re.compile(pattern)
    return {k: after[k] - before.get(k, 0.0) for k in after if rx.search(k)}


# -- running -------------------------------------------------------------------------------------
def _commit() -> str | None:
    """The checkout's commit (a run's code), with '+' when the tree has uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def run(args) -> None:
    out = Path(args.out)
    runs_path = out.parent / f"{out.name}_runs.json"
    data = json.loads(runs_path.read_text()) if runs_path.exists() else {"runs": []}
    done = {(r["deployment"], r["workload"], r["qps"]) for r in data["runs"]}
    data.update(machine=machine(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                command="python -m bench.disagg_goodput " + " ".join(sys.argv[1:]),
                serve_flags=args.serve_flags.split(), deployments=DEPLOYMENTS,
                duration_s=args.duration, drain_s=args.drain, seed=args.seed)
    traces = workloads()
    rates = {"sharegpt": [float(q) for q in args.rates_sharegpt.split(",")],
             "long": [float(q) for q in args.rates_long.split(",")]}
    todo = [(d, w, q) for d in args.deployments.split(",") for w in args.workloads.split(",")
            for q in rates[w] if (d, w, q) not in done]
    print(f"{len(todo)} runs to do ({len(done)} already in {runs_path})", file=sys.stderr)
    for dep in dict.fromkeys(d for d, _, _ in todo):
        t = time.monotonic()
        stack = Stack(dep, args.serve_flags.split(), out.parent / "logs")
        print(f"[{dep}] ready in {time.monotonic() - t:.0f} s at {stack.url}", file=sys.stderr)
        try:
            # one short request first: lazy loads (tokenizer, kernels) are not part of a run
            run_http(stack.url, make_workload(traces["sharegpt"], 2, 1.0, seed=99, vocab_size=VOCAB),
                     drain_s=120)
            for _, wl, qps in [x for x in todo if x[0] == dep]:
                n = max(1, math.ceil(qps * args.duration))
                workload = make_workload(traces[wl], n, qps, seed=args.seed, vocab_size=VOCAB)
                before = stack.metrics()
                t = time.monotonic()
                rr = run_http(stack.url, workload, drain_s=args.drain)
                after = stack.metrics()
                s = summarize(rr.records, None, rr.end_time)
                print(f"[{dep}] {wl} @ {qps:g} QPS ({n} req, {time.monotonic() - t:.0f} s): "
                      f"finished {s['finished']}/{n}, P50 TTFT {s['ttft_p50_s']:.2f} s, "
                      f"P99 TBT {s['tbt_p99_s']:.3f} s", file=sys.stderr)
                data["runs"].append(dict(
                    deployment=dep, workload=wl, qps=qps, commit=_commit(),
                    env={k: v for k, v in os.environ.items() if k.startswith("SARATHI_")},
                    requests=[r.to_dict() for r in rr.records],
                    end_time=rr.end_time, summary=s,
                    metrics=_metric_delta(before, after, r"kv_transfer|ttft|disagg|prefill_pool|handoff")))
                runs_path.write_text(json.dumps(json_safe(data)))
        finally:
            stack.close()
    report(args)


# -- evaluating ----------------------------------------------------------------------------------
def _records(run: dict) -> list[RequestRecord]:
    return [RequestRecord(**{k: v for k, v in r.items()}) for r in run["requests"]]


def attainment(records: list[RequestRecord], ttft_slo: float, tbt_slo: float) -> float:
    """Share of requests with TTFT <= ttft_slo and mean TBT <= tbt_slo (unfinished: miss)."""
    ok = 0
    for r in records:
        if not r.finished or r.ttft > ttft_slo:
            continue
        gaps = r.tbts
        if not gaps or sum(gaps) / len(gaps) <= tbt_slo:
            ok += 1
    return ok / len(records)


def _highest(points: list[tuple[float, bool]]) -> float:
    """The highest rate whose run and all lower rates' runs pass; 0 if the lowest fails."""
    best = 0.0
    for q, ok in sorted(points):
        if not ok:
            break
        best = q
    return best


def _crossing(points: list[tuple[float, float]], level: float) -> float | None:
    """Where attainment(rate) first falls below level, linearly interpolated (None if never
    within the tested rates; 0 if the lowest rate is already below)."""
    pts = sorted(points)
    if pts and pts[0][1] < level:
        return 0.0
    for (q0, a0), (q1, a1) in zip(pts, pts[1:]):
        if a1 < level <= a0:
            return q0 + (q1 - q0) * (a0 - level) / (a0 - a1)
    return None


def evaluate(data: dict, slos: dict[str, tuple[float, float]]) -> dict:
    cells = []
    for wl in dict.fromkeys(r["workload"] for r in data["runs"]):
        for name, (ttft, tbt) in slos.items():
            for dep in dict.fromkeys(r["deployment"] for r in data["runs"]):
                runs = sorted((r for r in data["runs"] if r["workload"] == wl and r["deployment"] == dep),
                              key=lambda r: r["qps"])
                att = [(r["qps"], attainment(_records(r), ttft, tbt)) for r in runs]
                p99 = [(r["qps"], _f(r["summary"]["tbt_p99_s"])) for r in runs]
                cells.append(dict(workload=wl, slo=name, ttft_slo_s=ttft, tbt_slo_s=tbt, deployment=dep,
                                  attainment=att, tbt_p99_s=p99,
                                  goodput_qps=_highest([(q, a >= ATTAINMENT) for q, a in att]),
                                  goodput_crossing_qps=_crossing(att, ATTAINMENT),
                                  capacity_qps=_highest([(q, v <= tbt) for q, v in p99])))
    return {"cells": cells, "transfer": _transfer(data)}


def _f(x) -> float:
    return float("inf") if x == "inf" else float(x)


def _transfer(data: dict) -> list[dict]:
    """Per disaggregating run: KV transfer seconds and bytes per transferred request (from the
    scheduler's metrics, differenced around the run) against the run's median TTFT."""
    out = []
    for r in data["runs"]:
        m = r.get("metrics") or {}
        secs = sum(v for k, v in m.items() if "kv_transfer_seconds_sum" in k)
        count = sum(v for k, v in m.items() if "kv_transfer_seconds_count" in k)
        nbytes = sum(v for k, v in m.items() if "kv_transfer_bytes_sum" in k)
        if count:
            ttft = percentile([_f(x["token_times"][0]) - x["arrival"] for x in r["requests"]
                               if x["token_times"]], 50)
            out.append(dict(deployment=r["deployment"], workload=r["workload"], qps=r["qps"],
                            transfers=count, transfer_s_mean=secs / count, bytes_mean=nbytes / count,
                            ttft_p50_s=ttft, transfer_share_of_ttft_p50=(secs / count) / ttft if ttft else None))
    return out


def report(args) -> None:
    out = Path(args.out)
    data = json.loads((out.parent / f"{out.name}_runs.json").read_text())
    slos = parse_slos(args.slo)
    result = {k: data[k] for k in ("machine", "date", "command", "serve_flags", "deployments",
                                   "duration_s", "drain_s", "seed")}
    result.update(slos={k: {"ttft_s": a, "tbt_s": b} for k, (a, b) in slos.items()},
                  attainment_target=ATTAINMENT, **evaluate(data, slos),
                  runs=[{k: r.get(k) for k in ("deployment", "workload", "qps", "commit", "env", "summary",
                                               "metrics")} for r in data["runs"]])
    out.with_suffix(".json").write_text(json.dumps(json_safe(result), indent=1))
    print(table(result))
    plot(result, data, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}", file=sys.stderr)
    for spec in args.timeline or []:
        wl, qps = spec.split(":")
        path = out.parent / f"{out.name}_timeline_{wl}_{qps}.png"
        timeline(data, wl, float(qps), path)
        print(f"wrote {path}", file=sys.stderr)


def timeline(data: dict, workload: str, qps: float, path: Path) -> None:
    """Per deployment, one run (workload at qps): each request's TTFT at its arrival time and
    every token gap at the time it closed, so a reader sees where a deployment queues prompts
    (TTFT grows) or stalls decodes (gaps grow)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in data["runs"] if r["workload"] == workload and r["qps"] == qps]
    fig, axes = plt.subplots(2, len(runs), figsize=(4.2 * len(runs), 6), squeeze=False, sharey="row")
    for j, r in enumerate(runs):
        recs = _records(r)
        ax = axes[0][j]
        ax.scatter([x.arrival for x in recs], [min(x.ttft, 1e3) for x in recs], s=10,
                   c=[x.prompt_tokens for x in recs], cmap="viridis")
        ax.set(title=f"{r['deployment']}: {workload} @ {qps:g} QPS", xlabel="arrival (s)",
               ylabel="TTFT (s; colour: prompt tokens)", yscale="log")
        ax = axes[1][j]
        for x in recs:
            t = x.token_times
            ax.plot(t[1:], [b - a for a, b in zip(t, t[1:])], ".", ms=2, color="tab:blue")
        ax.set(xlabel="time (s)", ylabel="gap between tokens (s)", yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(result: dict) -> str:
    lines = ["| workload | SLO (TTFT, TBT) | " + " | ".join(
        f"{d} goodput / capacity (QPS)" for d in result["deployments"] if any(
            c["deployment"] == d for c in result["cells"])) + " |"]
    deps = [d for d in result["deployments"] if any(c["deployment"] == d for c in result["cells"])]
    lines.append("|---|---|" + "---|" * len(deps))
    keys = dict.fromkeys((c["workload"], c["slo"]) for c in result["cells"])
    for wl, slo in keys:
        row = {c["deployment"]: c for c in result["cells"] if c["workload"] == wl and c["slo"] == slo}
        any_c = next(iter(row.values()))
        cells = []
        for d in deps:
            c = row.get(d)
            if c is None:
                cells.append("-")
                continue
            x = c["goodput_crossing_qps"]
            cells.append(f"{c['goodput_qps']:g} (~{x:.2f}) / {c['capacity_qps']:g}" if x is not None
                         else f"{c['goodput_qps']:g} (>= all) / {c['capacity_qps']:g}")
        lines.append(f"| {wl} | {slo} ({any_c['ttft_slo_s']:g} s, {any_c['tbt_slo_s']:g} s) | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = list(dict.fromkeys(c["workload"] for c in result["cells"]))
    slos = list(result["slos"])
    fig, axes = plt.subplots(len(wls), len(slos) + 1, figsize=(4.2 * (len(slos) + 1), 3.4 * len(wls)),
                             squeeze=False)
    colors = {"colocated": "tab:blue", "disagg": "tab:red", "auto": "tab:green", "auto-tbt": "tab:olive"}
    for i, wl in enumerate(wls):
        for j, slo in enumerate(slos):
            ax = axes[i][j]
            for c in result["cells"]:
                if c["workload"] == wl and c["slo"] == slo:
                    q, a = zip(*c["attainment"]) if c["attainment"] else ((), ())
                    ax.plot(q, [100 * x for x in a], "o-", color=colors.get(c["deployment"]),
                            label=f"{c['deployment']} (goodput {c['goodput_qps']:g})")
            s = result["slos"][slo]
            ax.axhline(100 * ATTAINMENT, color="grey", ls=":")
            ax.set(title=f"{wl}: {slo} (TTFT {s['ttft_s']:g} s, TBT {s['tbt_s']:g} s)",
                   xlabel="request rate (QPS)", ylabel="requests meeting both SLOs (%)", ylim=(-3, 103))
            ax.legend(fontsize=7)
        ax = axes[i][-1]
        for dep in dict.fromkeys(r["deployment"] for r in data["runs"]):
            runs = sorted((r for r in data["runs"] if r["workload"] == wl and r["deployment"] == dep),
                          key=lambda r: r["qps"])
            ax.plot([r["qps"] for r in runs], [_f(r["summary"]["ttft_p50_s"]) for r in runs], "o-",
                    color=colors.get(dep), label=f"{dep} P50 TTFT")
            ax.plot([r["qps"] for r in runs], [_f(r["summary"]["tbt_p99_s"]) for r in runs], "s--",
                    color=colors.get(dep), label=f"{dep} P99 TBT")
        ax.set(title=f"{wl}: latency by rate", xlabel="request rate (QPS)", ylabel="seconds", yscale="log")
        ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"{m['cpu']}, {m['cpus']} CPUs ({m['isa']}); last sweep started {result['date']}; "
                 f"{result['duration_s']:g} s of Poisson arrivals per point; attainment = TTFT <= SLO and "
                 "mean TBT <= SLO; dotted: 90%", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.disagg_goodput", description=__doc__.split("\n")[0])
    p.add_argument("action", choices=["run", "report"])
    p.add_argument("--out", default="bench/results/disagg/goodput")
    p.add_argument("--deployments", default="colocated,disagg,auto")
    p.add_argument("--workloads", default="sharegpt,long")
    p.add_argument("--rates-sharegpt", default="0.25,0.5,0.75,1.0")
    p.add_argument("--rates-long", default="0.25,0.5,0.75,1.0")
    p.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per run")
    p.add_argument("--drain", type=float, default=30.0, help="seconds after the last arrival")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-flags", default="--threads 1 --num-blocks 2048 --token-budget 256",
                   help="flags every deployment's `sarathi serve` gets")
    p.add_argument("--slo", action="append", default=None,
                   help="NAME=TTFT_S,TBT_S (repeat); default: three pairs for this CPU")
    p.add_argument("--timeline", action="append", default=None,
                   help="WORKLOAD:QPS (report): a timeline figure of that run for every deployment")
    args = p.parse_args(argv)
    args.slo = args.slo or ["strict-tbt=8,0.25", "strict-ttft=1.5,1.0", "balanced=3,0.5"]
    (run if args.action == "run" else report)(args)


if __name__ == "__main__":
    main()
