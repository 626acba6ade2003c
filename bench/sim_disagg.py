"""Colocated vs disaggregated vs conditional (auto) serving at GPU scale, simulated.
The comparison of bench/results/disagg/ on simulated A100s. Results: bench/results/sim/disagg_*.

Llama-3-8B on A100s (the GPU cost model's measured shape), two GPUs in every configuration, all
three run by the SAME coordinator code (scheduler_svc.pools.PoolSet + Router on the virtual clock,
sarathi.measure.simulate.run_pools):

* colocated: 2 mixed pools, `--disaggregation off`, sarathi with tau planned for the TBT SLO;
* disagg:    1 prefill + 1 decode pool, `--disaggregation all` (prefill pool token budget 2048);
* auto:      1 prefill + 1 decode pool, `--disaggregation auto`, the decode pool at the planned tau,
             threshold = `sarathi plan`'s disagg_threshold for the TBT SLO, backlog margin 2048.

KV transfer: prompt blocks x 16 tokens x 128 KiB (Llama-3-8B bf16: 32 layers x K,V x 8 KV heads x
128 x 2 B) over an ASSUMED 25 GB/s link (one 200 Gb/s RDMA NIC between nodes); the prefill worker
waits for it (its next iteration starts after) and it is part of the request's TTFT.

Workloads: (a) ShareGPT (the packaged length trace, unscaled, prompt + output <= 8192), (b) long
prompts: outputs uniform in [64, 256] tokens, prompts 8-16x their output (512-4096 tokens).
SLO pairs (TTFT s, TBT s): strict TBT + loose TTFT (8, 0.05), loose TBT + strict TTFT (0.5, 0.2),
balanced (2, 0.1). Per (workload, SLO pair, deployment) one Poisson run per rate of a grid.

* goodput (DistServe): the highest grid rate at which >= 90% of requests meet BOTH the TTFT SLO
  and the TBT SLO (per request: mean time between tokens <= TBT SLO; unfinished = miss), every
  lower grid rate passing too; `crossing`: where attainment crosses 90% (linear interpolation);
* capacity (the paper): the highest grid rate with P99 TBT <= TBT SLO and P50 scheduling delay
  <= 2 s (every lower rate passing too).

    python -m bench.sim_disagg run --only sharegpt --out bench/results/sim/disagg_sharegpt
    python -m bench.sim_disagg run --only long --out bench/results/sim/disagg_long
    python -m bench.sim_disagg report --out ...      # tables + PNG from the saved runs
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from bench.disagg_goodput import ATTAINMENT, _crossing, _highest, attainment
from sarathi.measure.env import machine
from sarathi.measure.gpu_costmodel import GPUCostModel
from sarathi.measure.metrics import RequestRecord, json_safe, meets_slo
from sarathi.measure.plan import plan_disagg_threshold, plan_token_budget
from sarathi.measure.simulate import pool_target
from sarathi.measure.tools import Workload, run_once
from sarathi.measure.trace import Trace, load_trace
from shared.config import SchedulerConfig

OUT = Path("bench/results/sim/disagg_sharegpt")
SLOS = {"strict_tbt": (8.0, 0.05), "strict_ttft": (0.5, 0.2), "balanced": (2.0, 0.1)}
GRIDS = {"sharegpt": [0.5, 1, 1.5, 2, 3, 4, 5, 6, 7, 8, 10, 12],
         "long": [0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 10]}
KV_LINK_GBS = 25.0
PREFILL_BUDGET = 2048
BACKLOG_MARGIN = 2048
BLOCK = 16
MAX_LEN = 8192
PLAN_CONTEXT = 4096   # `sarathi plan --device a100`'s default decode context
DEPLOYMENTS = ("colocated", "disagg", "auto")


def model() -> GPUCostModel:
    return GPUCostModel("llama-3-8b", "a100", kv_link_gbs=KV_LINK_GBS)


def workload_trace(name: str, n: int = 2000, seed: int = 0) -> Trace:
    if name == "sharegpt":
        return load_trace(max_total_len=MAX_LEN)
    rng = np.random.default_rng(seed)
    out = rng.integers(64, 257, n)
    prompt = np.round(out * rng.uniform(8, 16, n)).astype(int)
    return Trace([int(p) for p in prompt], [int(o) for o in out],
                 "long prompts: outputs U[64, 256], prompts x U[8, 16] (seed 0)")


def plans(m: GPUCostModel) -> dict:
    """Per SLO pair: the planned tau and disaggregation threshold (sarathi plan's rules)."""
    kv = m.shape.kv_bytes_per_token(m.shape.num_layers, 1)
    out = {}
    for slo, (_, tbt) in SLOS.items():
        p = plan_token_budget(m, tbt, context=PLAN_CONTEXT, decode_batch=32)
        d = plan_disagg_threshold(m, tbt, context=PLAN_CONTEXT, decode_batch=p["decode_batch"],
                                  kv_bytes_per_token=kv, kv_link_gbs=KV_LINK_GBS)
        out[slo] = {"token_budget": p["token_budget"], "disagg_threshold": d["disagg_threshold"],
                    "threshold_kv_transfer_s": d["kv_transfer_s"]}
    return out


def target(m: GPUCostModel, dep: str, plan: dict | None):
    kv = m.shape.kv_bytes_per_token(m.shape.num_layers, 1)
    common = dict(block_size=BLOCK, num_blocks=m.kv_blocks(BLOCK), max_model_len=MAX_LEN,
                  kv_bytes_per_token=kv, kv_link_gbs=KV_LINK_GBS, sched_config=SchedulerConfig(),
                  keep_transfers=False, vocab_size=128256)
    if dep == "colocated":
        return pool_target(m, roles=["mixed", "mixed"], mode="off", **common)
    return pool_target(m, roles=["prefill", "decode"], mode="all" if dep == "disagg" else "auto",
                       threshold_tokens=plan["disagg_threshold"] if plan else 0,
                       backlog_margin_tokens=BACKLOG_MARGIN, prefill_token_budget=PREFILL_BUDGET, **common)


def one_run(m, wl: str, dep: str, slo: str | None, plan: dict | None, qps: float, n: int, drain: float) -> dict:
    w = Workload(workload_trace(wl), n, drain_s=drain, seed=0)
    tau = plan["token_budget"] if plan else 512
    t0 = time.time()
    r = run_once(target(m, dep, plan), w, qps, policy="sarathi", token_budget=tau, progress=False)
    recs = [RequestRecord(**d) for d in r["requests"]]
    s = r["summary"]
    att = {name: attainment(recs, ttft, tbt) for name, (ttft, tbt) in SLOS.items()}
    return {"workload": wl, "deployment": dep, "slo": slo, "qps": qps, "token_budget": tau,
            "disagg_threshold": plan["disagg_threshold"] if plan and dep == "auto" else None,
            "attainment": att, "summary": s, "wall_s": round(time.time() - t0, 2)}


def runs_path(out: Path) -> Path:
    return out.with_name(out.name + "_runs.json")


def run(a) -> None:
    m = model()
    out = Path(a.out)
    path = runs_path(out)
    data = json.loads(path.read_text()) if path.exists() else {"runs": []}
    have = {(r["workload"], r["deployment"], r["slo"], r["qps"]) for r in data["runs"]}
    pl = plans(m)
    data.update(plans=pl, num_requests=a.num_requests, drain_s=a.drain, machine=machine(),
                command="python -m bench.sim_disagg " + " ".join(sys.argv[1:]),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    for wl in a.only.split(","):
        for dep in DEPLOYMENTS:
            # disagg's runs do not depend on the SLO pair (prefill budget fixed, decode pool only decodes)
            for slo in ([None] if dep == "disagg" else list(SLOS)):
                for q in GRIDS[wl]:
                    if (wl, dep, slo, q) in have:
                        continue
                    r = one_run(m, wl, dep, slo, pl[slo] if slo else None, q, a.num_requests, a.drain)
                    data["runs"].append(r)
                    s = r["summary"]
                    print(f"{wl} {dep} {slo} {q:g} QPS: att {r['attainment'][slo or 'balanced']:.2f} "
                          f"P99 TBT {s['tbt_p99_s']:.3f} TTFT P50 {s['ttft_p50_s']:.3f} "
                          f"disagg {s.get('disaggregated_requests', 0)} ({r['wall_s']} s)", flush=True)
                    path.write_text(json.dumps(json_safe(data)))
    report(a)


def _f(x) -> float:
    return math.inf if x == "inf" else (math.nan if x == "nan" else float(x))


def evaluate(data: dict) -> list[dict]:
    cells = []
    for wl in dict.fromkeys(r["workload"] for r in data["runs"]):
        for slo, (ttft, tbt) in SLOS.items():
            for dep in DEPLOYMENTS:
                runs = sorted((r for r in data["runs"] if r["workload"] == wl and r["deployment"] == dep
                               and r["slo"] in (slo, None)), key=lambda r: r["qps"])
                if not runs:
                    continue
                att = [(r["qps"], r["attainment"][slo]) for r in runs]
                cap = [(r["qps"], meets_slo({k: _f(v) if isinstance(v, str) else v
                                             for k, v in r["summary"].items()}, tbt, 2.0)) for r in runs]
                good = _highest([(q, x >= ATTAINMENT) for q, x in att])
                at = next((r for r in runs if r["qps"] == good), None)
                s = at["summary"] if at else {}
                cells.append(dict(workload=wl, slo=slo, ttft_slo_s=ttft, tbt_slo_s=tbt, deployment=dep,
                                  token_budget=runs[0]["token_budget"],
                                  disagg_threshold=runs[0]["disagg_threshold"],
                                  goodput_qps=good, goodput_crossing_qps=_crossing(att, ATTAINMENT),
                                  capacity_qps=_highest(cap), attainment=att,
                                  at_goodput={k: s.get(k) for k in (
                                      "ttft_p50_s", "tbt_p99_s", "disaggregated_requests",
                                      "kv_transfer_p50_s", "disagg_ttft_p50_s",
                                      "kv_transfer_share_of_ttft_p50", "kv_bytes_p50")}))
    return cells


def verdicts(cells: list[dict]) -> list[dict]:
    out = []
    for wl in dict.fromkeys(c["workload"] for c in cells):
        for slo in SLOS:
            by = {c["deployment"]: c for c in cells if c["workload"] == wl and c["slo"] == slo}
            if len(by) < 3:
                continue
            best = max(by["colocated"]["goodput_qps"], by["disagg"]["goodput_qps"])
            out.append(dict(workload=wl, slo=slo, auto=by["auto"]["goodput_qps"], best_other=best,
                            auto_reaches_best=by["auto"]["goodput_qps"] >= best))
    return out


def report(a) -> None:
    out = Path(a.out)
    data = json.loads(runs_path(out).read_text())
    cells = evaluate(data)
    res = {k: data[k] for k in ("command", "date", "machine", "plans", "num_requests", "drain_s")}
    res.update(model="llama-3-8b", device="a100", gpus_per_configuration=2, kv_link_gbs=KV_LINK_GBS,
               kv_link_assumption="25 GB/s between the prefill and the decode GPU (one 200 Gb/s RDMA NIC)",
               prefill_token_budget=PREFILL_BUDGET, backlog_margin_tokens=BACKLOG_MARGIN,
               slos={k: {"ttft_s": v[0], "tbt_s": v[1]} for k, v in SLOS.items()}, grids=GRIDS,
               attainment_target=ATTAINMENT, cells=cells, verdicts=verdicts(cells))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(json_safe(res), indent=1))
    print(table(res))
    plot(res, out.with_suffix(".png"))


def table(res: dict) -> str:
    lines = ["| workload | SLO (TTFT / TBT) | colocated | disagg | auto | auto >= best? "
             "| KV transfer / P50 TTFT (disagg, auto) |",
             "|---|---|---|---|---|---|---|"]
    for v in res["verdicts"]:
        by = {c["deployment"]: c for c in res["cells"] if c["workload"] == v["workload"] and c["slo"] == v["slo"]}
        cell = lambda c: f"{c['goodput_qps']:g} / {c['capacity_qps']:g}"   # noqa: E731
        share = ", ".join("-" if by[d]["at_goodput"].get("kv_transfer_share_of_ttft_p50") in (None, "nan")
                          else f"{_f(by[d]['at_goodput']['kv_transfer_share_of_ttft_p50']):.1%}"
                          for d in ("disagg", "auto"))
        s = res["slos"][v["slo"]]
        lines.append(f"| {v['workload']} | {v['slo']} ({s['ttft_s']:g} s / {s['tbt_s'] * 1e3:g} ms) | "
                     f"{cell(by['colocated'])} | {cell(by['disagg'])} | {cell(by['auto'])} | "
                     f"{'yes' if v['auto_reaches_best'] else 'NO'} | {share} |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = list(dict.fromkeys(c["workload"] for c in res["cells"]))
    fig, axes = plt.subplots(len(wls), len(SLOS), figsize=(5 * len(SLOS), 3.8 * len(wls)), squeeze=False)
    colors = {"colocated": "tab:blue", "disagg": "tab:red", "auto": "tab:green"}
    for i, wl in enumerate(wls):
        for j, slo in enumerate(SLOS):
            ax = axes[i][j]
            for c in res["cells"]:
                if c["workload"] == wl and c["slo"] == slo:
                    q, x = zip(*c["attainment"])
                    ax.plot(q, x, ".-", color=colors[c["deployment"]],
                            label=f"{c['deployment']} (goodput {c['goodput_qps']:g})")
            ax.axhline(ATTAINMENT, color="k", ls=":", lw=0.8)
            s = res["slos"][slo]
            ax.set(title=f"{wl}: {slo} (TTFT {s['ttft_s']:g} s, TBT {s['tbt_s'] * 1e3:g} ms)",
                   xlabel="Poisson rate (req/s)", ylabel="SLO attainment", ylim=(-0.02, 1.02))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"Llama-3-8B, 2 x A100 (simulated), KV link {res['kv_link_gbs']:g} GB/s", y=1.0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.sim_disagg", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["run", "report"])
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--only", default="sharegpt,long")
    p.add_argument("--num-requests", type=int, default=400)
    p.add_argument("--drain", type=float, default=120.0)
    a = p.parse_args()
    run(a) if a.what == "run" else report(a)


if __name__ == "__main__":
    main()
