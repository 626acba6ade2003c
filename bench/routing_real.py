"""Routing measured on two real CPU replicas: the shared queue against the endpoint picker's
scorers, multi-turn chat and single-turn ShareGPT, SmolLM2-135M, one core per replica.

Two deployments of two replicas each, both started once and kept up (the idle one sleeps):

* shared-queue: the distributed mode on one Redis stream (a private redis-server on a free port,
  a run-unique key prefix): 2 workers, 2 schedulers (distinct consumers) and 1 gateway;
* picker: 2 `sarathi serve` replicas with prefix caching and KV-cache events on, and in front
  of them bench/picker_router.py (started per run with the routing under test: least-queue,
  prefix or mix), which scrapes their vLLM metrics and follows their KV events over ZeroMQ.

In both, each replica's worker process is pinned to its own core (taskset) and runs torch with
one thread; the gateways, schedulers, router and load generator float. Every replica has prefix
caching on.

Decode step and SLO: the run starts with one replica alone (its worker on core 0), timing the
decode-only iteration of a batch of --slo-batch requests (calibrate). The P99 TBT SLO is the
paper's strict one on this machine: 5 x that iteration (docs/measuring.md: the paper takes batch
32 at 4k contexts; here the contexts are the short ones of this workload). Standing in for the
paper's P50 scheduling delay <= 2 s (an HTTP client cannot see it): P50 TTFT <= --ttft-p50-bound.
The replicas then run the sarathi policy with --token-budget adaptive under that SLO (tau
follows the iteration times; a fixed tau can be given instead).

Runs: for every rate of --rates (total QPS over both replicas) every routing of --routings,
interleaved (rate by rate), each over the same workload (same seed, lengths and arrival
times). So that a run finds nothing of an earlier run in the caches, each run's token ids are
shifted by its own offset (a bijection of the vocabulary: what shares a prefix within a run
still does, nothing across runs). Chat runs start with --warmup seconds of earlier turns,
left out of the metrics; the prefix-hit rate is the replicas' own counters
(vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total) over the measured window.
Capacity: the highest rate of the list that meets the SLO, below the first one that does not.

    python -m bench.routing_real --out bench/results/routing    # chat, then sharegpt
    python -m bench.routing_real report --out bench/results/routing
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np

from bench.common import free_port
from sarathi.measure.env import machine
from sarathi.measure.loadgen import ChatShape, RequestSpec, make_chat_workload, make_workload, run_http
from sarathi.measure.metrics import json_safe, meets_slo, summarize
from sarathi.measure.scrape import summed
from sarathi.measure.trace import Trace, load_trace

ROOT = Path(__file__).resolve().parent.parent
ROUTINGS = ("shared-queue", "least-queue", "prefix", "mix", "kv-cost", "cache-aware")


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def counters(urls: list[str]) -> dict[str, float]:
    """vllm: counters and gauges summed over the replicas' /metrics pages."""
    out: dict[str, float] = {}
    for u in urls:
        for name, value in summed(get(u), "vllm:").items():
            out[name] = out.get(name, 0.0) + value
    return out


class Procs:
    """The processes this benchmark started (each in its own session, stopped by its group)."""

    def __init__(self, logdir: Path):
        self.logdir, self.procs = logdir, []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SARATHI_")}
        self.env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.logdir / f"{name}.log", "wb") as log:
            p = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        self.procs.append((name, p))
        return p

    def wait_ready(self, url: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                get(url, 2.0)
                return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            dead = [n for n, p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                tail = "".join((self.logdir / f"{n}.log").read_text()[-1500:] for n in dead)
                raise RuntimeError(f"{url} not ready (exited: {dead})\n{tail}")
            time.sleep(0.5)

    def stop(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        self.procs = [(n, q) for n, q in self.procs if q is not p]

    def stop_all(self) -> None:
        for _, p in reversed(list(self.procs)):
            self.stop(p)


def sarathi(role: str, **opts) -> list[str]:
    argv = [sys.executable, "-m", "sarathi.cli", role]
    for k, v in opts.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is not None:
            argv += [flag, str(v)]
    return argv


def pin(pid: int, cpu: int) -> None:
    """Pin every thread of `pid` to `cpu`."""
    subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], check=True, stdout=subprocess.DEVNULL)


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class Deployments:
    """Both deployments of two replicas, up for the whole benchmark."""

    def __init__(self, a: argparse.Namespace, procs: Procs, tbt_slo_s: float):
        self.a, self.procs = a, procs
        common = dict(threads=1, num_blocks=a.num_blocks)
        sched = dict(prefix_caching=True, token_budget=a.token_budget, max_model_len=a.max_model_len,
                     tbt_slo=tbt_slo_s if a.token_budget == "adaptive" else None)
        # -- picker: two `sarathi serve`, KV events on loopback
        self.replicas, self.serve_metrics = [], []
        serve_procs = []
        for k in range(2):
            port, ev, rp = free_port(), free_port(), free_port()
            cfg = {"endpoint": f"tcp://127.0.0.1:{ev}", "replay_endpoint": f"tcp://127.0.0.1:{rp}",
                   "topic": f"kv@replica-{k}@SmolLM2-135M-Instruct", "hash_seed": "0"}
            serve_procs.append(procs.start(f"serve{k}", sarathi("serve", port=port, kv_events_config=json.dumps(cfg),
                                                                **common, **sched)))
            self.replicas.append(f"http://127.0.0.1:{port},tcp://127.0.0.1:{ev},tcp://127.0.0.1:{rp}")
            self.serve_metrics.append(f"http://127.0.0.1:{port}/metrics")
        # -- shared queue: a private Redis, 2 workers, 2 schedulers, 1 gateway
        rport = free_port()
        procs.start("redis", ["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"])
        redis_url, prefix = f"redis://127.0.0.1:{rport}/0", f"routing-real:{uuid.uuid4().hex[:8]}:"
        self.sq_metrics, workers = [], []
        for k in range(2):
            wport, mport = free_port(), free_port()
            workers.append(procs.start(f"worker{k}", sarathi("worker", bind=f"tcp://127.0.0.1:{wport}", **common)))
            procs.start(f"scheduler{k}", sarathi("scheduler", worker_addr=f"tcp://127.0.0.1:{wport}",
                                                 redis_url=redis_url, queue_prefix=prefix, metrics_port=mport,
                                                 consumer=f"replica-{k}", **sched))
            self.sq_metrics.append(f"http://127.0.0.1:{mport}/metrics")
        gport = free_port()
        procs.start("gateway", sarathi("gateway", redis_url=redis_url, queue_prefix=prefix, port=gport,
                                       max_model_len=a.max_model_len))
        self.sq_url = f"http://127.0.0.1:{gport}"
        for u in self.serve_metrics + self.sq_metrics:
            procs.wait_ready(u.replace("/metrics", "/ready"))
        procs.wait_ready(self.sq_url + "/ready")
        # one core per replica's worker process; everything else floats
        for k, p in enumerate(serve_procs):
            kids = children(p.pid)    # the worker (and multiprocessing's idle resource tracker)
            if not kids:
                raise RuntimeError(f"serve{k}: no worker child process")
            for kid in kids:
                pin(kid, k)
        for k, p in enumerate(workers):
            pin(p.pid, k)
        self.router = None

    def target(self, routing: str) -> tuple[str, list[str]]:
        """(URL to send the run to, the replicas' metrics URLs) for `routing`."""
        if self.router is not None:
            self.procs.stop(self.router)
            self.router = None
        if routing == "shared-queue":
            return self.sq_url, self.sq_metrics
        port = free_port()
        argv = [sys.executable, "-m", "bench.picker_router", "--routing", routing, "--port", str(port),
                "--poll", str(self.a.poll)]
        for r in self.replicas:
            argv += ["--replica", r]
        argv += shlex.split(self.a.router_args)
        self.router, self.router_url = self.procs.start(f"router-{routing}", argv), f"http://127.0.0.1:{port}"
        self.procs.wait_ready(self.router_url + "/health")
        return f"http://127.0.0.1:{port}", self.serve_metrics

    def router_stats(self) -> dict | None:
        if self.router is None:
            return None
        return json.loads(get(self.router_url + "/stats"))

    def wait_idle(self, metrics: list[str], timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            c = counters(metrics)
            if c.get("vllm:num_requests_running", 0) + c.get("vllm:num_requests_waiting", 0) == 0:
                return True
            time.sleep(0.5)
        return False


def shifted(workload: list[RequestSpec], offset: int, vocab: int, delay: float) -> list[RequestSpec]:
    """The workload with every token id t -> (t + offset) mod vocab and every arrival + delay."""
    return [RequestSpec(s.req_id, s.arrival + delay, [(t + offset) % vocab for t in s.prompt_ids], s.max_tokens)
            for s in workload]


def calibrate(a: argparse.Namespace, procs: Procs) -> dict:
    """One replica alone (`sarathi serve`, its worker pinned to core 0, a fixed tau of 128):
    the decode step d (median token gap of one request alone, 32-token prompt), the decode-only
    iteration of a batch of --slo-batch requests (64-token prompts, all admitted at once: the
    gaps after the last first token), and one 512-token prefill alone (its TTFT)."""
    port = free_port()
    p = procs.start("calibrate", sarathi("serve", port=port, threads=1, num_blocks=a.num_blocks, prefix_caching=True,
                                         token_budget=128, max_model_len=a.max_model_len))
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_ready(url + "/ready")
        for kid in children(p.pid):
            pin(kid, 0)
        rng = np.random.default_rng(12345)
        solo = []
        for i in range(3):
            w = [RequestSpec(f"solo{i}", 0.0, rng.integers(100, 30000, 32).tolist(), 32)]
            solo.append(summarize(run_http(url, w, drain_s=60).records)["tbt_p50_s"])
        w = [RequestSpec(f"b{i}", 0.0, rng.integers(100, 30000, 64).tolist(), 32) for i in range(a.slo_batch)]
        recs = run_http(url, w, drain_s=120).records
        last_first = max(r.token_times[0] for r in recs)
        gaps = [y - x for r in recs for x, y in zip(r.token_times, r.token_times[1:]) if x >= last_first]
        w = [RequestSpec("prefill", 0.0, rng.integers(100, 30000, 512).tolist(), 1)]
        prefill = summarize(run_http(url, w, drain_s=60).records)["ttft_p50_s"]
    finally:
        procs.stop(p)
    return {"decode_step_s": float(np.median(solo)), "solo_samples_s": solo,
            "decode_batch": a.slo_batch, "decode_batch_step_s": float(np.median(gaps)),
            "decode_batch_gaps": len(gaps), "prefill_512_s": prefill}


def path_ttft(urls: dict[str, str], n: int = 5) -> dict[str, float]:
    """Median TTFT (s) of n requests one after another (64-token prompts, 8 tokens) on each
    path, the deployments idle: what a request pays for its way in (router or gateway + queue)."""
    rng = np.random.default_rng(777)
    out = {}
    for name, url in urls.items():
        w = [RequestSpec(f"{name}{i}", 0.0, rng.integers(100, 30000, 64).tolist(), 8) for i in range(n)]
        out[name] = float(np.median([summarize(run_http(url, [s], drain_s=30).records)["ttft_p50_s"] for s in w]))
    return out


def workloads(a: argparse.Namespace, kind: str, qps: float, seed: int) -> tuple[list[RequestSpec], float]:
    """(the run's requests, warm-up seconds before the measured ones: arrivals from 0)."""
    base = load_trace(None)
    if kind == "chat":
        trace = Trace(base.prompt_lens, [min(o, a.max_tokens) for o in base.output_lens], "sharegpt, capped")
        shape = ChatShape(system_prompts=a.system_prompts, system_len=a.system_len, turns=(2, a.max_turns),
                          user_scale=a.user_scale, think_s=a.think, answer_s_per_token=a.answer_s_per_token,
                          warmup_s=a.warmup)
        w = make_chat_workload(trace, max(1, round(qps * a.duration)), qps, shape, seed=seed,
                               vocab_size=a.vocab, max_total_len=a.max_model_len)
        warm = -min(s.arrival for s in w)
        return [RequestSpec(s.req_id, s.arrival + warm, s.prompt_ids, s.max_tokens) for s in w], warm
    keep = [(max(1, round(p * a.sharegpt_prompt_scale)), min(o, a.max_tokens))
            for p, o in zip(base.prompt_lens, base.output_lens)]
    keep = [(p, o) for p, o in keep if p + o <= a.max_model_len]
    trace = Trace([p for p, _ in keep], [o for _, o in keep], "sharegpt, scaled")
    return make_workload(trace, max(1, round(qps * a.duration)), qps, seed=seed, vocab_size=a.vocab), 0.0


def one_run(dep: Deployments, routing: str, reqs: list[RequestSpec], warm: float, offset: int,
            a: argparse.Namespace) -> dict:
    url, metrics = dep.target(routing)
    if not dep.wait_idle(metrics):
        print(f"  warning: {routing} replicas not idle before the run", file=sys.stderr)
    before = {}

    def snap():
        before.update(counters(metrics))
    timer = threading.Timer(warm, snap)    # the measured window's start (run_http's clock starts ~now)
    t0 = time.time()
    timer.start()
    rr = run_http(url, shifted(reqs, offset, a.vocab, 0.0), drain_s=a.drain)
    timer.join()
    after = counters(metrics)
    measured = [r for r in rr.records if r.arrival >= warm]
    s = summarize(measured, end_time=rr.end_time)
    q = after.get("vllm:prefix_cache_queries_total", 0) - before.get("vllm:prefix_cache_queries_total", 0)
    h = after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0)
    s["prefix_hit_rate"] = h / q if q > 0 else None
    s["prefix_cache_queries"], s["prefix_cache_hits"] = q, h
    s["preemptions"] = after.get("vllm:num_preemptions_total", 0) - before.get("vllm:num_preemptions_total", 0)
    s["warmup_requests"] = len(rr.records) - len(measured)
    s["wall_s"] = time.time() - t0
    stats = dep.router_stats()
    if stats is not None:
        s["router"] = stats
    return s


def run(a: argparse.Namespace) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logdir = Path(tempfile.mkdtemp(prefix="routing-real-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # a `timeout` still stops every server
    procs = Procs(logdir)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rates = sorted(float(x) for x in a.rates.split(","))
    budgets = [float(x) for x in str(a.budget_min).split(",")]
    wls = a.workloads.split(",")
    earlier = {wl: json.loads((out / f"routing_real_{wl}.json").read_text()) for wl in wls} if a.append else {}
    try:
        if a.append:    # another hold: the first hold's SLO, no calibration
            slos = {r["slo"]["tbt_p99_s"] for r in earlier.values()}
            if len(slos) != 1:
                raise ValueError(f"--append: the workloads' results hold different SLOs {slos}")
            d, slo = None, slos.pop()
        else:
            d = calibrate(a, procs)
            slo = a.slo_factor * d["decode_batch_step_s"]
        if d is not None:
            print(f"decode step {d['decode_step_s'] * 1e3:.1f} ms alone, {d['decode_batch_step_s'] * 1e3:.1f} ms at "
                  f"batch {a.slo_batch}, 512-token prefill {d['prefill_512_s']:.2f} s -> P99 TBT SLO "
                  f"{slo * 1e3:.0f} ms",
                  file=sys.stderr, flush=True)
        dep = Deployments(a, procs, slo)
        paths = path_ttft({"serve replica, direct": dep.serve_metrics[0].replace("/metrics", "")})
        paths.update(path_ttft({"router (mix) + serve replica": dep.target("mix")[0]}))
        paths.update(path_ttft({"gateway + Redis + scheduler": dep.target("shared-queue")[0]}))
        print("TTFT alone per path: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in paths.items()),
              file=sys.stderr, flush=True)
        n_run = 0
        for wi, wl in enumerate(wls):
            routings = (a.routings_sharegpt if wl == "sharegpt" else a.routings).split(",")
            budget_s, t_start = budgets[min(wi, len(budgets) - 1)] * 60, time.monotonic()
            res = {"command": "python -m bench.routing_real " + " ".join(sys.argv[1:]), "machine": machine(),
                   "started": started, "workload": wl, "replicas": 2, "model": "SmolLM2-135M-Instruct",
                   "settings": {k: v for k, v in vars(a).items() if k not in ("mode", "out")},
                   "decode_step": d, "slo": {"tbt_p99_s": slo, "factor": a.slo_factor,
                                             "ttft_p50_s": a.ttft_p50_bound},
                   "runs": []}
            if a.append:    # the runs of this hold join the earlier holds' (each run says its hold)
                res = earlier[wl]
                res.pop("stopped", None)
                res.setdefault("holds", []).append({"command": "python -m bench.routing_real " + " ".join(sys.argv[1:]),
                                                    "started": started, "machine": machine(), "path_ttft_s": paths})
            else:
                res["path_ttft_s"] = paths
            hold = len(res.get("holds", []))
            walls = []
            for ri, qps in enumerate(rates):
                prev = [x for x in res["runs"] if x["qps"] == rates[ri - 1]] if ri else []
                if prev and not any(x["ok"] for x in prev):
                    res["stopped"] = f"every routing missed the SLO at {rates[ri - 1]:g} QPS"
                    break
                if walls and time.monotonic() - t_start + np.mean(walls) * len(routings) > budget_s:
                    res["stopped"] = f"the time budget ({budget_s / 60:g} min) before {qps:g} QPS"
                    break
                reqs, warm = workloads(a, wl, qps, seed=a.seed + ri)
                for routing in routings:
                    n_run += 1
                    s = one_run(dep, routing, reqs, warm, offset=7919 * n_run, a=a)
                    ok = meets_slo(s, slo, max_ttft_p50_s=a.ttft_p50_bound)
                    res["runs"].append({"qps": qps, "routing": routing, "ok": ok, "hold": hold, "summary": s})
                    walls.append(s["wall_s"] + 5.0)
                    hit = "-" if s["prefix_hit_rate"] is None else f"{s['prefix_hit_rate']:.0%}"
                    print(f"{wl} {routing} @ {qps:g} QPS: TTFT P50 {s['ttft_p50_s']:.3f} P99 {s['ttft_p99_s']:.3f} s,"
                          f" TBT P99 {s['tbt_p99_s'] * 1e3:.0f} ms, hits {hit}, unfinished {s['unfinished']}"
                          f" -> {'ok' if ok else 'miss'} ({s['wall_s']:.0f} s)", file=sys.stderr, flush=True)
                    (out / f"routing_real_{wl}.json").write_text(json.dumps(json_safe(res), indent=1))
            if "stopped" in res:
                print(f"{wl}: stopped: {res['stopped']}", file=sys.stderr)
                (out / f"routing_real_{wl}.json").write_text(json.dumps(json_safe(res), indent=1))
    finally:
        procs.stop_all()
        if a.keep_logs:
            print(f"logs: {logdir}", file=sys.stderr)
        else:
            shutil.rmtree(logdir, ignore_errors=True)


def capacity_of(runs: list[dict], routing: str) -> tuple[float | None, float | None]:
    """(highest passing rate below the first failing one, that failing rate)."""
    probes = sorted((r["qps"], r["ok"]) for r in runs if r["routing"] == routing)
    cap, fail = None, None
    for q, ok in probes:
        if not ok:
            fail = q
            break
        cap = q
    return cap, fail


def report(a: argparse.Namespace) -> None:
    out = Path(a.out)
    rows = []
    results = [json.loads(p.read_text()) for p in sorted(out.glob("routing_real_*.json"))]
    for r in results:
        for routing in ROUTINGS:
            runs = [x for x in r["runs"] if x["routing"] == routing]
            if not runs:
                continue
            cap, fail = capacity_of(r["runs"], routing)
            rows.append({"workload": r["workload"], "routing": routing, "capacity_qps": cap, "first_failing_qps": fail,
                         "per_rate": [{"qps": x["qps"], "ok": x["ok"], "ttft_p50_s": x["summary"]["ttft_p50_s"],
                                       "ttft_p99_s": x["summary"]["ttft_p99_s"], "tbt_p99_s": x["summary"]["tbt_p99_s"],
                                       "prefix_hit_rate": x["summary"]["prefix_hit_rate"],
                                       "unfinished": x["summary"]["unfinished"]} for x in runs]})
    (out / "summary_real.json").write_text(json.dumps(json_safe({"rows": rows, "slo": {
        r["workload"]: r["slo"] for r in results}}), indent=1))
    for row in rows:
        for x in row["per_rate"]:
            hit = "-" if x["prefix_hit_rate"] in (None, "nan") else f"{x['prefix_hit_rate']:.0%}"
            print(f"| {row['workload']} | {row['routing']} | {x['qps']:g} | {float(x['ttft_p50_s']):.3f} / "
                  f"{float(x['ttft_p99_s']):.3f} | {float(x['tbt_p99_s']) * 1e3:.0f} | {hit} | "
                  f"{x['unfinished']} | {'ok' if x['ok'] else 'miss'} |")
        print(f"capacity {row['workload']} {row['routing']}: {row['capacity_qps']} "
              f"(fails at {row['first_failing_qps']})")
    _plot(results, out / "routing_real.png")


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"shared-queue": "tab:gray", "least-queue": "tab:blue", "prefix": "tab:orange", "mix": "tab:green",
              "kv-cost": "tab:purple", "cache-aware": "tab:brown"}
    fig, axes = plt.subplots(len(results), 4, figsize=(18, 3.8 * len(results)), squeeze=False)
    for j, r in enumerate(results):
        for routing in ROUTINGS:
            runs = sorted((x for x in r["runs"] if x["routing"] == routing), key=lambda x: x["qps"])
            if not runs:
                continue
            q = [x["qps"] for x in runs]
            cap, fail = capacity_of(r["runs"], routing)
            cap_s = f"< {q[0]:g}" if cap is None else (f">= {cap:g}" if fail is None else f"{cap:g}")
            lab = f"{routing} (capacity {cap_s} QPS)"
            for k, key in enumerate(("ttft_p50_s", "ttft_p99_s", "tbt_p99_s")):
                y = [float(x["summary"][key]) for x in runs]
                axes[j][k].plot(q, y, "o-", color=colors[routing], label=lab)
            hits = [x["summary"]["prefix_hit_rate"] for x in runs]
            axes[j][3].plot(q, [float(h) * 100 if h not in (None, "nan") else np.nan for h in hits], "o-",
                            color=colors[routing], label=routing)
        for k, name in enumerate(("TTFT P50 (s)", "TTFT P99 (s)", "TBT P99 (s)",
                                  "prefix-cache hits (% of prompt tokens)")):
            ax = axes[j][k]
            ax.set_xlabel("QPS (2 replicas)")
            ax.set_ylabel(name)
            if k < 3:
                ax.set_yscale("log")
            ax.set_title(f"{r['workload']}, 2 x 1 CPU core, SmolLM2-135M")
        axes[j][0].axhline(r["slo"]["ttft_p50_s"], color="r", ls=":", lw=1)
        axes[j][2].axhline(r["slo"]["tbt_p99_s"], color="r", ls=":", lw=1)
        axes[j][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="run", choices=["run", "report"])
    p.add_argument("--workloads", default="chat,sharegpt")
    p.add_argument("--routings", default=",".join(ROUTINGS[:4]), help="comma-separated, of " + ", ".join(ROUTINGS))
    p.add_argument("--router-args", default="", help="more arguments of bench.picker_router for every picker "
                   "routing, e.g. '--balance-abs-threshold 4' (recorded in the JSON's settings)")
    p.add_argument("--routings-sharegpt", default="shared-queue,mix", help="the routings of --workloads sharegpt "
                   "(no prefix is shared there: prefix alone is a coin toss, least-queue is mix's load part)")
    p.add_argument("--rates", default="1,2,3,4", help="total QPS over both replicas, comma-separated "
                   "(ascending; a rate where every routing misses the SLO ends the list)")
    p.add_argument("--budget-min", default="6.5,3", help="per workload (comma-separated, in --workloads' "
                   "order): no new rate once this many minutes would be exceeded (a rate's runs stay together)")
    p.add_argument("--duration", type=float, default=25.0, help="seconds of measured arrivals per run")
    p.add_argument("--warmup", type=float, default=10.0, help="chat: seconds of earlier turns first (left out)")
    p.add_argument("--drain", type=float, default=15.0, help="seconds after the last arrival before unfinished")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request at most")
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--user-scale", type=float, default=0.03, help="a user turn: a ShareGPT prompt x this")
    p.add_argument("--think", type=float, default=3.0)
    p.add_argument("--answer-s-per-token", type=float, default=0.02)
    p.add_argument("--sharegpt-prompt-scale", type=float, default=0.125)
    p.add_argument("--token-budget", default="adaptive", help="the replicas' tau: a number, or adaptive (tau "
                   "follows the iteration times to stay under the SLO measured first)")
    p.add_argument("--slo-batch", type=int, default=32, help="the decode-only batch whose iteration x --slo-factor "
                   "is the P99 TBT SLO")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=49152, help="the model's vocabulary (token ids below it)")
    p.add_argument("--slo-factor", type=float, default=5.0, help="P99 TBT SLO = this x the decode-only iteration "
                   "of --slo-batch requests")
    p.add_argument("--ttft-p50-bound", type=float, default=2.0, help="seconds")
    p.add_argument("--poll", type=float, default=0.05, help="router: seconds between metric scrapes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--append", action="store_true", help="another hold: add its runs to the workloads' results "
                   "(their SLO, no calibration; --seed N makes its first rate's workload the N-th of a list)")
    p.add_argument("--out", default="bench/results/routing")
    a = p.parse_args(argv)
    {"run": run, "report": report}[a.mode](a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
