"""Routing measured: the shared queue's pull against the inference gateway's endpoint-picker
scorers, on simulated A100 replicas, multi-turn chat and single-turn ShareGPT.

Llama-3-8B on A100s (the GPU cost model), N independent replicas (scheduler + worker each, the
unchanged scheduler on a virtual clock, sarathi.measure.simulate.run_replicas), sarathi policy,
tau 512, prefix caching on in every replica for every routing. Routings
(sarathi.measure.routing): shared-queue (today's distributed mode), least-queue (the picker's
queue + KV-usage scorers), prefix (its prefix-cache scorer alone, fed by the KV-cache events), mix
(prefix 3 + queue 1 + KV 1, the picker's default weights); and the two other published cache-aware
routers, kv-cost (NVIDIA Dynamo's KV router cost) and cache-aware (SGLang's router policy).

Per (replicas, workload):
* capacity (the paper's criterion: P99 TBT <= 100 ms, the strict SLO of the simulated results, and
  P50 scheduling delay <= 2 s) of each routing in --capacity-routings, by binary search
  (resolution --resolution), every probe a run of --duration seconds of arrivals;
* one run per routing at a common rate (the shared queue's capacity, or --qps): TTFT P50 / P99,
  prefix-cache hit rate.

Workloads: chat (sarathi.measure.loadgen.make_chat_workload: 4 shared system prompts of 512
tokens, 2-8 turns, a user turn 0.25 x a ShareGPT prompt, answers of ShareGPT output lengths, 5 s
mean think time; --warmup seconds of earlier turns run first and are left out: conversations
older than that start the measured window with their history uncached, which favours no
routing), sharegpt (one request
per trace row, the packaged ShareGPT length trace).

    python -m bench.routing --replicas 4 --out bench/results/routing
    python -m bench.routing --replicas 8 --out bench/results/routing
    python -m bench.routing probe --replicas 4 --workloads chat --routing mix --qps-list 22.75 \
        --out bench/results/routing                                  # refine a capacity bracket
    python -m bench.routing report --out bench/results/routing     # summary JSON + PNG
    python -m bench.routing weights --replicas 4 --workloads chat --qps-list 21,23 \
        --weights-list 3:1:1,1:1:1,3:3:0 --out bench/results/routing   # the picker's weights swept
    python -m bench.routing lowq --replicas 4 --workloads chat --qps-list 21,23 \
        --thresholds 0,4,16 --out bench/results/routing             # the low-queue filter before mix
    python -m bench.routing fc --replicas 4 --workloads chat --qps-list 15.3,21 \
        --out bench/results/routing                       # the picker's flow control in front of mix

Each replica runs at most --max-num-seqs requests at once (default 128; its other requests wait
in its queue): a push routing (the picker's) can fill that cap where the shared queue's pull,
which takes only what a replica has room for, does not. --wait-for-answer: a chat follow-up is
sent no earlier than its think time after the answer it replies to ended (default: open loop, at
its scheduled time); capacities are then the request rates achieved, not the scheduled ones.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from sarathi.measure.env import machine
from sarathi.measure.gpu_costmodel import GPUCostModel
from sarathi.measure.loadgen import ChatShape
from sarathi.measure.metrics import json_safe
from sarathi.measure.simulate import simulated_target
from sarathi.measure.tools import Workload, capacity, run_once
from sarathi.measure.trace import load_trace
from shared.config import SchedulerConfig

ROUTINGS = ("shared-queue", "least-queue", "prefix", "mix", "kv-cost", "cache-aware")
TBT_SLO = 0.1
TAU = 512
CHAT = ChatShape(system_prompts=4, system_len=512, turns=(2, 8), user_scale=0.25, think_s=5.0)
# a routing + a tier suffix: the same routing with a KV tier all replicas share
# (sarathi.measure.simulate.KVTier) of --tier-blocks-per-replica x replicas blocks, its loads
# before the batch that needs them (+tier, LMCache's default) or layer by layer beside it
# (+tier-lw, its layerwise mode), e.g. mix+tier; only where --capacity-routings or --routing
# name them
TIERS = {"+tier": False, "+tier-lw": True}


def _split(routing: str) -> tuple[str, str]:
    """(routing, tier suffix or "")."""
    base, plus, rest = routing.partition("+")
    if plus and plus + rest not in TIERS:
        raise ValueError(f"unknown tier suffix +{rest!r} of {routing!r}; choose one of {', '.join(TIERS)}")
    return base, plus + rest


def _sim_target(cost, a: argparse.Namespace, routing: str, blocks: int, sched: SchedulerConfig):
    """simulated_target for `routing`, which may end in a suffix of TIERS (a shared KV tier,
    loads over a 25 GB/s host link, the model's KV bytes a token)."""
    base, tier = _split(routing)
    return simulated_target(cost, replicas=a.replicas, num_blocks=blocks, max_model_len=8192, sched_config=sched,
                            routing=base, kv_tier_blocks=a.tier_blocks_per_replica * a.replicas if tier else 0,
                            tier_load_overlap=TIERS.get(tier, False),
                            kv_bytes_per_token=cost.shape.kv_bytes_per_token(cost.shape.num_layers, 1) if tier else 0)


def _chat_shape(warmup_s: float, wait_for_answer: bool = False) -> ChatShape:
    import dataclasses
    return dataclasses.replace(CHAT, warmup_s=warmup_s, wait_for_answer=wait_for_answer)


def run(a: argparse.Namespace) -> None:
    cost = GPUCostModel("llama-3-8b", "a100")
    blocks = cost.kv_blocks(16, 0.9)
    trace = load_trace(None, max_total_len=8192)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for wl in a.workloads.split(","):
        w = Workload(trace, a.num_requests, seed=a.seed, drain_s=a.drain, duration_s=a.duration,
                     chat=_chat_shape(a.warmup, a.wait_for_answer) if wl == "chat" else None)
        res = {"command": "python -m bench.routing " + " ".join(sys.argv[1:]), "machine": machine(),
               "replicas": a.replicas, "workload": wl, "chat": json_safe(vars(w.chat)) if w.chat else None,
               "model": "llama-3-8b", "device": "a100", "num_blocks_per_replica": blocks, "policy": "sarathi",
               "token_budget": TAU, "tbt_slo_s": TBT_SLO, "max_sched_delay_s": 2.0, "duration_s": a.duration,
               "drain_s": a.drain, "seed": a.seed, "max_num_seqs": a.max_num_seqs, "capacity": {},
               "at_common_qps": {}}
        sched = SchedulerConfig(enable_prefix_caching=True, max_num_seqs=a.max_num_seqs)
        t0 = time.time()
        for routing in a.capacity_routings.split(","):
            target = _sim_target(cost, a, routing, blocks, sched)
            c = capacity(target, w, TBT_SLO, policy="sarathi", token_budget=TAU,
                         qps_start=a.qps_start or a.replicas * 3.0, resolution=a.resolution, progress=False)
            res["capacity"][routing] = {"capacity_qps": c["capacity_qps"], "bracket": c["bracket"],
                                        "probes": [{"qps": p["qps"], "ok": p["ok"], "summary": p["summary"]}
                                                   for p in c["probes"]]}
            print(f"{a.replicas} replicas {wl} {routing}: capacity {c['capacity_qps']:.3g} QPS "
                  f"({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        common = a.qps or res["capacity"].get("shared-queue", {}).get("capacity_qps") or a.replicas * 3.0
        res["common_qps"] = common
        for routing in ROUTINGS + tuple(x for x in a.capacity_routings.split(",") if _split(x)[1]):
            target = _sim_target(cost, a, routing, blocks, sched)
            r = run_once(target, w, common, policy="sarathi", token_budget=TAU, progress=False,
                         keep_requests=False)
            s = r["summary"]
            res["at_common_qps"][routing] = s
            print(f"{a.replicas} replicas {wl} {routing} @ {common:.3g} QPS: TTFT P50 {s['ttft_p50_s']:.3f} s "
                  f"P99 {s['ttft_p99_s']:.3f} s, P99 TBT {s['tbt_p99_s']:.3f} s, prefix hits "
                  f"{s['prefix_hit_rate']:.1%} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        (out / f"routing_{wl}_{a.replicas}r.json").write_text(json.dumps(json_safe(res), indent=1))


def _probe_target(a: argparse.Namespace, routing: str):
    """(workload name, Workload, Target) of a probe: --replicas simulated A100 replicas routed
    by `routing`, the single workload of --workloads."""
    cost = GPUCostModel("llama-3-8b", "a100")
    trace = load_trace(None, max_total_len=8192)
    (wl,) = a.workloads.split(",")
    w = Workload(trace, a.num_requests, seed=a.seed, drain_s=a.drain, duration_s=a.duration,
                 chat=_chat_shape(a.warmup, a.wait_for_answer) if wl == "chat" else None)
    target = _sim_target(cost, a, routing, cost.kv_blocks(16, 0.9),
                         SchedulerConfig(enable_prefix_caching=True, max_num_seqs=a.max_num_seqs))
    return wl, w, target


def _judged_run(a: argparse.Namespace, target, w: Workload, q: float, what: str) -> tuple[bool, dict]:
    """One run at q QPS, judged by the capacity criterion, printed as `what`: (ok, summary)."""
    from sarathi.measure.metrics import meets_slo

    s = run_once(target, w, q, policy="sarathi", token_budget=TAU, progress=False, keep_requests=False)["summary"]
    ok = meets_slo(s, TBT_SLO, 2.0, None)
    print(f"{a.replicas} replicas {what} @ {q:g}: {'ok' if ok else 'miss'} (P50 sched delay "
          f"{s['sched_delay_p50_s']:.2f} s, P99 TBT {s['tbt_p99_s']:.3f} s)", file=sys.stderr, flush=True)
    return ok, s


def probe(a: argparse.Namespace) -> None:
    """Refine a capacity bracket: one run per rate of --qps-list for --routing, each judged by the
    same criterion; appended to the configuration's JSON under "refine"."""
    wl, w, target = _probe_target(a, a.routing)
    path = Path(a.out) / f"routing_{wl}_{a.replicas}r.json"
    res = json.loads(path.read_text())
    for q in (float(x) for x in a.qps_list.split(",")):
        ok, s = _judged_run(a, target, w, q, f"{wl} {a.routing}")
        res.setdefault("refine", {}).setdefault(a.routing, []).append({"qps": q, "ok": ok, "summary": s})
        path.write_text(json.dumps(json_safe(res), indent=1))


def _capacity(r: dict, routing: str) -> tuple[float | None, float | None]:
    """(highest passing rate, lowest failing rate above it) over the search and the refinements.
    With follow-ups that wait for their answers (--wait-for-answer) a probe's rate is the one
    its requests achieved (requests sent in the window / its seconds), not the scheduled one: a
    slower setup's users send less (their turns wait), so scheduled rates do not compare."""
    c = r["capacity"].get(routing)
    if c is None:
        return None, None
    probes = c["probes"] + r.get("refine", {}).get(routing, [])
    waits = bool((r.get("chat") or {}).get("wait_for_answer"))

    def rate(p: dict) -> float:
        return p["summary"]["requests"] / r["duration_s"] if waits else p["qps"]
    best = max((p for p in probes if p["ok"]), key=lambda p: p["qps"], default=None)
    above = [p for p in probes if not p["ok"] and (best is None or p["qps"] > best["qps"])]
    lo = rate(best) if best is not None else 0.0
    hi = rate(min(above, key=lambda p: p["qps"])) if above else None
    return lo, hi


def report(a: argparse.Namespace) -> None:
    out = Path(a.out)
    rows = []
    for p in sorted(out.glob("routing_*_*r.json")):
        r = json.loads(p.read_text())
        tiered = [x for x in r["capacity"] if _split(x)[1]]
        for routing in ROUTINGS + tuple(tiered):
            s = r["at_common_qps"].get(routing)
            cap, cap_hi = _capacity(r, routing)
            if s is None and cap is None:   # a run of fewer routings
                continue
            base, base_hi = _capacity(r, "shared-queue")
            rows.append({"replicas": r["replicas"], "workload": r["workload"], "routing": routing,
                         "capacity_qps": cap, "first_failing_qps": cap_hi,
                         "capacity_vs_shared_queue": cap / base if cap and base else None,
                         "ratio_bounds": [cap / base_hi if cap and base_hi else None,
                                          cap_hi / base if cap_hi and base else None],
                         "common_qps": r["common_qps"], "ttft_p50_s": s and s["ttft_p50_s"],
                         "ttft_p99_s": s and s["ttft_p99_s"], "tbt_p99_s": s and s["tbt_p99_s"],
                         "prefix_hit_rate": s and s["prefix_hit_rate"]})
    (out / "summary.json").write_text(json.dumps(json_safe({"rows": rows}), indent=1))
    for row in rows:
        cap = "-" if row["capacity_qps"] is None else f"{row['capacity_qps']:.3g}"
        rel = "" if row["capacity_vs_shared_queue"] is None else f" ({row['capacity_vs_shared_queue']:.2f}x)"
        if row["first_failing_qps"]:
            cap += f" (< {row['first_failing_qps']:.3g})"
        # (a run that left requests unfinished has an infinite P99, written "inf" in the JSON)
        ttft = "-" if row["ttft_p50_s"] is None else \
            f"{float(row['ttft_p50_s']):.3f} / {float(row['ttft_p99_s']):.3f}"
        hits = "-" if row["prefix_hit_rate"] is None else f"{row['prefix_hit_rate']:.1%}"
        print(f"| {row['replicas']} | {row['workload']} | {row['routing']} | {cap}{rel} | {ttft} | {hits} |")
    _plot(rows, out / "routing.png")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["workload"], r["replicas"]) for r in rows})
    most = max(sum(1 for r in rows if (r["workload"], r["replicas"]) == c) for c in configs)
    fig, axes = plt.subplots(2, len(configs), figsize=(max(4.0, 0.5 * most) * len(configs), 7.5), squeeze=False)
    colors = {"shared-queue": "tab:gray", "least-queue": "tab:blue", "prefix": "tab:orange", "mix": "tab:green",
              "kv-cost": "tab:purple", "cache-aware": "tab:brown"}
    for j, (wl, n) in enumerate(configs):
        sel = [r for r in rows if r["workload"] == wl and r["replicas"] == n]
        names = [r["routing"] for r in sel]
        ax = axes[0][j]
        measured = [r for r in sel if r["capacity_qps"]]
        caps = [r["capacity_qps"] for r in measured]
        # (with --wait-for-answer a failing probe may achieve no more than the passing one)
        up = [max(0.0, (r["first_failing_qps"] or r["capacity_qps"]) - r["capacity_qps"]) for r in measured]
        ax.bar([r["routing"] for r in measured], caps, color=[colors[_split(r["routing"])[0]] for r in measured],
               hatch=[{"": "", "+tier": "//", "+tier-lw": ".."}[_split(r["routing"])[1]] for r in measured],
               yerr=[[0] * len(caps), up], capsize=4)
        ax.set_title(f"{wl}, {n} x A100 (Llama-3-8B)")
        ax.set_ylabel("capacity (QPS; bar: first failing rate)")
        plt.setp(ax.get_xticklabels(), rotation=35, ha="right")
        ax = axes[1][j]
        x = range(len(sel))
        for dx, key, label in ((-0.2, "ttft_p50_s", "P50"), (0.2, "ttft_p99_s", "P99")):
            vals = [float(r[key]) if r[key] is not None else math.nan for r in sel]
            ax.bar([i + dx for i in x], [v if math.isfinite(v) else math.nan for v in vals], 0.4, label=label)
            for i, v in zip(x, vals):   # unfinished requests: an infinite percentile, marked
                if math.isinf(v):
                    ax.annotate("inf", (i + dx, 1), xycoords=("data", "axes fraction"), ha="center", va="top")
        ax.set_xticks(list(x), names, rotation=35, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel(f"TTFT (s) at {sel[0]['common_qps']:.3g} QPS")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _sweep(a: argparse.Namespace, routing: str, name: str, apply, default: dict, describe, xlabel: str) -> None:
    """One run per (setting of --weights-list, rate of --qps-list) of `routing`, each judged by
    the capacity criterion; apply(setting) sets a module-level parameter the routing reads at
    each pick, and the value before is put back whatever happens; written to
    routing_{workload}_{N}r_{name}.json (+ PNG), `default` (the parameter's default) in it."""
    from sarathi.measure import routing as R

    wl, w, target = _probe_target(a, routing)
    res = {"command": "python -m bench.routing " + " ".join(sys.argv[1:]), "machine": machine(),
           "replicas": a.replicas, "workload": wl, **default, "runs": []}
    saved = dict(R.WEIGHTS["mix"]), R.KV_COST_OVERLAP_WEIGHT
    try:
        for setting in a.weights_list.split(","):
            apply(setting)
            for q in (float(x) for x in a.qps_list.split(",")):
                ok, s = _judged_run(a, target, w, q, f"{wl} {describe(setting)}")
                res["runs"].append({"weights": setting, "qps": q, "ok": ok, "summary": s})
    finally:
        R.WEIGHTS["mix"], R.KV_COST_OVERLAP_WEIGHT = saved
    path = Path(a.out) / f"routing_{wl}_{a.replicas}r_{name}.json"
    path.write_text(json.dumps(json_safe(res), indent=1))
    _plot_weights(res, path.with_suffix(".png"), xlabel=xlabel)


def weights(a: argparse.Namespace) -> None:
    """The picker's weights swept: the mix routing with each prefix:queue:kv setting of
    --weights-list at each rate of --qps-list (_sweep; routing_{workload}_{N}r_weights.json). The
    endpoint picker's configuration sets these weights per scorer; this asks whether another
    setting than the default 3:1:1 moves capacity."""
    from sarathi.measure import routing as R

    def apply(setting: str) -> None:    # the picker reads WEIGHTS["mix"] at each pick
        pw, qw, kw = (float(x) for x in setting.split(":"))
        R.WEIGHTS["mix"] = {"prefix": pw, "queue": qw, "kv": kw}
    _sweep(a, "mix", "weights", apply, {"default_weights": dict(R.WEIGHTS["mix"])}, lambda x: f"mix {x}",
           "mix weights prefix:queue:kv")


def kvcost(a: argparse.Namespace) -> None:
    """Dynamo's overlap weight swept: the kv-cost routing with each weight of --weights-list (a
    prefill block's cost in KV blocks held; Dynamo's default 1) at each rate of --qps-list (_sweep;
    routing_{workload}_{N}r_kvcost.json). The question: does weighting the prefill work saved
    higher keep conversations where their history is?"""
    from sarathi.measure import routing as R

    def apply(setting: str) -> None:    # read at each pick
        R.KV_COST_OVERLAP_WEIGHT = float(setting)
    _sweep(a, "kv-cost", "kvcost", apply, {"default_weight": R.KV_COST_OVERLAP_WEIGHT},
           lambda x: f"kv-cost, overlap weight {x}", "kv-cost: overlap weight")


def lowq(a: argparse.Namespace) -> None:
    """The picker's low-queue filter in front of the mix: mix-lowq with each threshold of
    --thresholds at each rate of --qps-list, beside the mix without the filter, judged by the
    capacity criterion; written to routing_{workload}_{N}r_lowq.json (+ PNG). The question: does
    spreading a conversation off its cached replica when that replica's queue grows buy capacity?"""
    from sarathi.measure import routing as R

    wl, w, mixed = _probe_target(a, "mix")
    _, _, filtered = _probe_target(a, "mix-lowq")
    default = R.LOW_QUEUE_THRESHOLD
    res = {"command": "python -m bench.routing " + " ".join(sys.argv[1:]), "machine": machine(),
           "replicas": a.replicas, "workload": wl, "runs": []}
    try:
        for setting in ["none"] + a.thresholds.split(","):
            if setting != "none":
                R.LOW_QUEUE_THRESHOLD = int(setting)    # read when each run's picker is built
            for q in (float(x) for x in a.qps_list.split(",")):
                what = f"{wl} mix" + ("" if setting == "none" else f" low-queue <= {setting}")
                ok, summ = _judged_run(a, mixed if setting == "none" else filtered, w, q, what)
                res["runs"].append({"weights": "no filter" if setting == "none" else f"<= {setting}",
                                    "threshold": None if setting == "none" else int(setting),
                                    "qps": q, "ok": ok, "summary": summ})
    finally:
        R.LOW_QUEUE_THRESHOLD = default
    path = Path(a.out) / f"routing_{wl}_{a.replicas}r_lowq.json"
    path.write_text(json.dumps(json_safe(res), indent=1))
    _plot_weights(res, path.with_suffix(".png"), xlabel="mix: low-queue filter threshold (requests waiting)")


def fc(a: argparse.Namespace) -> None:
    """The picker's flow control (mix-fc: requests wait in the picker while the pool is saturated,
    sarathi.measure.routing) beside the mix without it, at each rate of --qps-list, judged by the
    capacity criterion: with the saturation detector's filter in the scheduling profile (saturated
    replicas are no candidates) and with its dispatch gate alone; written to
    routing_{workload}_{N}r_fc.json (+ PNG). The question: does holding requests at the picker,
    as the shared queue's pull holds them, buy the mix capacity?"""
    from sarathi.measure import routing as R

    wl, w, mixed = _probe_target(a, "mix")
    _, _, controlled = _probe_target(a, "mix-fc")
    default = R.SATURATION_FILTER
    res = {"command": "python -m bench.routing " + " ".join(sys.argv[1:]), "machine": machine(),
           "replicas": a.replicas, "workload": wl, "saturation": {"queue": R.SATURATION_QUEUE, "kv": R.SATURATION_KV},
           "runs": []}
    try:
        for setting in ("no flow control", "gate + filter", "gate alone"):
            R.SATURATION_FILTER = setting == "gate + filter"   # read at each pick
            for q in (float(x) for x in a.qps_list.split(",")):
                ok, summ = _judged_run(a, mixed if setting == "no flow control" else controlled, w, q,
                                       f"{wl} mix, {setting}")
                res["runs"].append({"weights": setting, "qps": q, "ok": ok, "summary": summ})
    finally:
        R.SATURATION_FILTER = default
    path = Path(a.out) / f"routing_{wl}_{a.replicas}r_fc.json"
    path.write_text(json.dumps(json_safe(res), indent=1))
    _plot_weights(res, path.with_suffix(".png"), xlabel="mix: the picker's flow control")


def _plot_weights(res: dict, png: Path, xlabel: str = "mix weights prefix:queue:kv") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["qps"] for r in res["runs"]})
    fig, axes = plt.subplots(1, len(rates), figsize=(4.5 * len(rates), 3.6), squeeze=False)
    for ax, q in zip(axes[0], rates):
        runs = [r for r in res["runs"] if r["qps"] == q]
        delays = [min(r["summary"]["sched_delay_p50_s"], 30.0) for r in runs]
        ax.bar([r["weights"] for r in runs], delays, color=["tab:green" if r["ok"] else "tab:red" for r in runs])
        ax.axhline(2.0, color="k", ls="--", lw=1, label="SLO: P50 scheduling delay 2 s")
        ax.set_title(f"{res['replicas']} replicas, {res['workload']} @ {q:g} QPS")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("P50 scheduling delay (s)")
        ax.tick_params(axis="x", rotation=45)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = {"run": run, "probe": probe, "report": report, "weights": weights, "lowq": lowq, "fc": fc, "kvcost": kvcost}
    p.add_argument("mode", nargs="?", default="run", choices=list(modes))
    p.add_argument("--routing", default="shared-queue", help="probe: the routing")
    p.add_argument("--qps-list", default="", help="probe, weights, lowq, fc, kvcost: comma-separated rates")
    p.add_argument("--weights-list", default="3:1:1", help="weights: comma-separated prefix:queue:kv settings of "
                   "mix; kvcost: comma-separated overlap weights of kv-cost")
    p.add_argument("--thresholds", default="0,4,16", help="lowq: comma-separated low-queue filter thresholds")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--workloads", default="chat,sharegpt")
    p.add_argument("--capacity-routings", default="shared-queue,mix")
    p.add_argument("--warmup", type=float, default=30.0, help="chat: seconds of earlier turns run first, left out")
    p.add_argument("--wait-for-answer", action="store_true",
                   help="chat: a turn is sent no earlier than its think time after the answer before it "
                        "ended (default: open loop, at its scheduled time)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--drain", type=float, default=60.0)
    p.add_argument("--resolution", type=float, default=0.1)
    p.add_argument("--qps-start", type=float, default=0.0)
    p.add_argument("--qps", type=float, default=0.0, help="the common rate (0: the shared queue's capacity)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=128,
                   help="each replica's cap on running requests (its scheduler's max_num_seqs)")
    p.add_argument("--tier-blocks-per-replica", type=int, default=4 * 28683,
                   help="routings ending in +tier: the shared KV tier's blocks per replica (default 4 x an "
                        "A100's KV blocks: 240 GB of Llama-3-8B's KV per replica, in host memory)")
    p.add_argument("--out", default="bench/results/routing")
    a = p.parse_args(argv)
    modes[a.mode](a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
