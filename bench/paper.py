"""The paper's comparisons on this machine, from the measurement tools (bench/results/paper/).

Real-engine inputs (run first, each under the exclusive CPU lock; commands in README.md there):
  profile.json                       sarathi profile --length-scale 0.125 --rounds 3
  real_{sarathi,vllm}.json           sarathi bench --qps 0.4,0.7 --duration 60 ... (real engine)
  real_{hybrid_only,chunked_only}.json, http_vs_inprocess_*.json

Then, with no lock (simulated worker, real scheduler):
  python -m bench.paper calibrate    fit the cost model on the profile + the real runs at the
                                     lower load; validate it on the held-out higher load
                                     (per-iteration error, and simulated vs real metrics)
  python -m bench.paper sim          plans, capacities (strict / relaxed SLO) per policy,
                                     latency-throughput curves, ablation, all via `sarathi`
                                     subcommands on the calibrated profile
  python -m bench.paper figures      summary.json + capacity / curves / timeline PNGs

Every `sarathi` command this runs is printed and kept in summary.json.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from bench.common import machine
from sarathi.measure.costmodel import CostModel, aggregates, fit_aggregates
from sarathi.measure.metrics import json_safe
from sarathi.measure.profile import cases

OUT = Path("bench/results/paper")
SCALE = "0.125"
TRAIN_QPS, TEST_QPS = 0.4, 0.7
CURVE_QPS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2]
BASELINES = ("vllm", "orca", "faster_transformer")
FIXED_TAUS = (256, 1024)
SIM_DURATION = "600"        # seconds of Poisson arrivals per capacity probe (sim)


def sarathi(*args: str) -> list[str]:
    cmd = ["sarathi", *args]
    print("$ " + " ".join(shlex.quote(a) for a in cmd), file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "sarathi.cli", *args, "--no-progress"]
                   if args[0] in ("bench", "capacity") else [sys.executable, "-m", "sarathi.cli", *args],
                   check=True, stdout=subprocess.DEVNULL)
    return cmd


def load(name: str) -> dict:
    return json.loads((OUT / f"{name}.json").read_text())


def _iter_rows(runs: list[dict]) -> list[tuple]:
    return [(i["prefill_tokens"] + i["decodes"], i["decode_kv"], i["prefill_pairs"],
             i["num_seqs"], i["duration"]) for r in runs for i in r["iterations"]]


def _errors(model: CostModel, rows: list[tuple]) -> dict:
    rel = sorted(abs(model.predict(*r[:4]) - r[4]) / r[4] for r in rows)
    return {"iterations": len(rows), "median_rel": rel[len(rel) // 2],
            "p90_rel": rel[int(0.9 * len(rel))],
            "total_time_ratio_pred_over_real": sum(model.predict(*r[:4]) for r in rows)
            / sum(r[4] for r in rows)}


def calibrate() -> None:
    prof = load("profile")
    shapes = [c["shapes"] for c in cases(prof["slo"]["context"])]
    prof_rows = [(*aggregates(s), p["seconds"]) for s, p in zip(shapes, prof["points"])]
    runs = {pol: load(f"real_{pol}")["runs"] for pol in ("sarathi", "vllm")}
    train = [r for rs in runs.values() for r in rs if r["qps"] == TRAIN_QPS]
    test = [r for rs in runs.values() for r in rs if r["qps"] == TEST_QPS]
    profile_only = CostModel.from_dict(prof["cost_model"])
    calibrated = fit_aggregates(prof_rows + _iter_rows(train))
    validation = {
        "train": f"profile cases + iterations of the real sarathi and vllm runs at {TRAIN_QPS} QPS",
        "test": f"iterations of the real sarathi and vllm runs at {TEST_QPS} QPS (held out)",
        "profile_only_model": {"train": _errors(profile_only, _iter_rows(train)),
                               "test": _errors(profile_only, _iter_rows(test))},
        "calibrated_model": {"train": _errors(calibrated, _iter_rows(train)),
                             "test": _errors(calibrated, _iter_rows(test))},
    }
    cal = dict(prof, cost_model=calibrated.to_dict(),
               calibration={"from": "profile.json + real_sarathi.json, real_vllm.json at "
                                    f"{TRAIN_QPS} QPS", "command": "python -m bench.paper calibrate"})
    (OUT / "profile_calibrated.json").write_text(json.dumps(json_safe(cal), indent=1))
    # simulated vs real metrics, same workload (trace, scale, seed, duration), both loads
    metrics = []
    for pol in ("sarathi", "vllm"):
        real = load(f"real_{pol}")
        tau = real["runs"][0]["token_budget"]
        cmd = sarathi("bench", "--executor", "sim", "--profile", str(OUT / "profile_calibrated.json"),
                      "--policy", pol, "--token-budget", str(tau), "--length-scale", SCALE,
                      "--duration", "60", "--drain", "45", "--qps", f"{TRAIN_QPS},{TEST_QPS}",
                      "--seed", "0", "--out", str(OUT / f"sim_{pol}"))
        sim = load(f"sim_{pol}")
        for r, s in zip(real["runs"], sim["runs"]):
            row = {"policy": pol, "qps": r["qps"], "held_out": r["qps"] == TEST_QPS}
            for k in ("ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "e2e_p50_s"):
                a, b = r["summary"][k], s["summary"][k]
                row[k] = {"real": a, "sim": b, "rel_err": (b - a) / a}
            metrics.append(row)
        validation.setdefault("sim_commands", []).append(" ".join(cmd))
    validation["metrics_sim_vs_real"] = metrics
    validation["machine"] = machine()
    (OUT / "validation.json").write_text(json.dumps(json_safe(validation), indent=1))
    print(json.dumps(json_safe({k: v for k, v in validation.items()
                                if k.endswith("model")}), indent=1))
    for m in metrics:
        print(m["policy"], m["qps"], {k: round(v["rel_err"], 3) for k, v in m.items()
                                       if isinstance(v, dict)})


def sim() -> None:
    prof = str(OUT / "profile_calibrated.json")
    commands = {}
    for slo in ("strict", "relaxed"):
        commands[f"plan_{slo}"] = sarathi("plan", "--profile", prof, "--slo", slo,
                                          "--out", str(OUT / f"plan_{slo}_calibrated.json"))
    common = ["--executor", "sim", "--profile", prof, "--length-scale", SCALE, "--seed", "0"]
    for slo in ("strict", "relaxed"):
        configs = [("sarathi", str(OUT / f"plan_{slo}_calibrated.json"), "sarathi_plan")]
        configs += [("sarathi", str(t), f"sarathi_tau{t}") for t in FIXED_TAUS]
        configs += [(p, "512", p) for p in BASELINES]
        for pol, tau, name in configs:
            commands[f"capacity_{slo}_{name}"] = sarathi(
                "capacity", *common, "--policy", pol, "--token-budget", tau, "--slo", slo,
                "--duration", SIM_DURATION, "--drain", "120", "--qps-start", "0.5",
                "--resolution", "0.02", "--out", str(OUT / f"capacity_{slo}_{name}"))
    qps = ",".join(str(q) for q in CURVE_QPS)
    for pol in ("sarathi",) + BASELINES:
        tau = str(OUT / "plan_strict_calibrated.json") if pol == "sarathi" else "512"
        commands[f"curve_{pol}"] = sarathi("bench", *common, "--policy", pol, "--token-budget", tau,
                                           "--duration", "300", "--drain", "120", "--qps", qps,
                                           "--no-details", "--out", str(OUT / f"curve_{pol}"))
    for pol in ("sarathi", "hybrid_only", "chunked_only"):
        commands[f"ablation_sim_{pol}"] = sarathi(
            "bench", *common, "--policy", pol, "--token-budget",
            str(OUT / "plan_strict.json"), "--duration", "60", "--drain", "45",
            "--qps", str(TEST_QPS), "--out", str(OUT / f"ablation_sim_{pol}"))
    (OUT / "sim_commands.json").write_text(json.dumps(
        {k: " ".join(shlex.quote(a) for a in v) for k, v in commands.items()}, indent=1))


def figures() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cmds = json.loads((OUT / "sim_commands.json").read_text())
    summary = {"machine": machine(), "length_scale": float(SCALE),
               "slo": load("profile_calibrated")["slo"], "capacity": {}, "commands": cmds}
    names = ["sarathi_plan"] + [f"sarathi_tau{t}" for t in FIXED_TAUS] + list(BASELINES)
    for slo in ("strict", "relaxed"):
        caps = {}
        for n in names:
            c = load(f"capacity_{slo}_{n}")
            caps[n] = {"capacity_qps": c["capacity_qps"], "token_budget": c["token_budget"],
                       "tbt_slo_s": c["tbt_slo_s"]}
        caps["sarathi_over_vllm"] = caps["sarathi_plan"]["capacity_qps"] / caps["vllm"]["capacity_qps"]
        summary["capacity"][slo] = caps
    fig, ax = plt.subplots(figsize=(9, 4.5))
    w = 0.38
    for k, slo in enumerate(("strict", "relaxed")):
        ys = [summary["capacity"][slo][n]["capacity_qps"] for n in names]
        bars = ax.bar([i + (k - 0.5) * w for i in range(len(names))], ys, w,
                      label=f"{slo} SLO ({summary['capacity'][slo]['vllm']['tbt_slo_s']:.2f} s)")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    labels = [f"sarathi tau={summary['capacity']['strict']['sarathi_plan']['token_budget']}/"
              f"{summary['capacity']['relaxed']['sarathi_plan']['token_budget']} (plan)"] + \
             [f"sarathi tau={t}" for t in FIXED_TAUS] + list(BASELINES)
    ax.set_xticks(range(len(names)), labels, rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="capacity (QPS)", title="Capacity: P99 TBT <= SLO, P50 scheduling delay <= 2 s "
           "(simulated worker, calibrated cost model)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "capacity.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for pol in ("sarathi",) + BASELINES:
        runs = load(f"curve_{pol}")["runs"]
        q = [r["qps"] for r in runs]
        fin = lambda v: v if isinstance(v, (int, float)) else float("nan")  # noqa: E731
        axes[0].plot(q, [fin(r["summary"]["tbt_p99_s"]) for r in runs], "o-", label=pol)
        axes[1].plot(q, [fin(r["summary"]["ttft_p50_s"]) for r in runs], "o-", label=pol)
    axes[0].axhline(summary["slo"]["strict_s"], color="r", ls=":", label="strict SLO")
    axes[0].axhline(summary["slo"]["relaxed_s"], color="m", ls=":", label="relaxed SLO")
    axes[0].set(xlabel="QPS", ylabel="P99 TBT (s)", yscale="log", title="P99 TBT against load")
    axes[1].set(xlabel="QPS", ylabel="P50 TTFT (s)", yscale="log", title="P50 TTFT against load")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "curves.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    for ax, pol in zip(axes, ("vllm", "sarathi")):
        run = next(r for r in load(f"real_{pol}")["runs"] if r["qps"] == TEST_QPS)
        its = run["iterations"]
        colors = ["tab:red" if i["prefill_tokens"] and not i["decodes"] else
                  "tab:orange" if i["prefill_tokens"] else "tab:blue" for i in its]
        ax.bar([i["start"] for i in its], [i["duration"] for i in its],
               width=[i["duration"] for i in its], align="edge", color=colors)
        stall = max((i["duration"] for i in its if i["prefill_tokens"] and not i["decodes"]),
                    default=0.0)
        ax.axhline(summary["slo"]["strict_s"], color="k", ls=":", lw=1)
        ax.set(ylabel="iteration (s)", title=f"{pol} at {TEST_QPS} QPS (real engine): "
               f"P99 TBT {run['summary']['tbt_p99_s']:.2f} s, longest prefill-only iteration "
               f"{stall:.2f} s")
    axes[1].set_xlabel("time since start (s); red: prefill-only (decodes stalled), orange: "
                       "hybrid, blue: decode-only; dotted: strict SLO")
    fig.tight_layout()
    fig.savefig(OUT / "timeline.png", dpi=110)
    plt.close(fig)

    ablation = {}
    for pol in ("hybrid_only", "chunked_only", "sarathi"):
        row = {}
        for kind, name in (("sim", f"ablation_sim_{pol}"), ("real", f"real_{pol}")):
            if (OUT / f"{name}.json").is_file():
                run = next(r for r in load(name)["runs"] if r["qps"] == TEST_QPS)
                row[kind] = {k: run["summary"][k] for k in ("ttft_p50_s", "tbt_p99_s", "tbt_p50_s")}
        ablation[pol] = row
    summary["ablation"] = ablation
    hv = {k: load(f"http_vs_inprocess_{k}")["runs"][0]["summary"] for k in ("inprocess", "http")}
    summary["http_vs_inprocess"] = {k: {m: hv[k][m] for m in ("ttft_p50_s", "ttft_p99_s",
                                                               "tbt_p50_s", "tbt_p99_s", "e2e_p50_s")}
                                    for k in hv}
    summary["validation"] = {k: v for k, v in load("validation").items() if k != "machine"}
    (OUT / "summary.json").write_text(json.dumps(json_safe(summary), indent=1))
    print(json.dumps(json_safe({k: summary[k] for k in ("capacity", "ablation", "http_vs_inprocess")}),
                     indent=1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["calibrate", "sim", "figures"])
    step = ap.parse_args(argv).step
    {"calibrate": calibrate, "sim": sim, "figures": figures}[step]()


if __name__ == "__main__":
    main()
