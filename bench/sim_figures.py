"""Figures and summary.json of bench/results/sim/ from the simulations bench.sim_paper ran (each
figure is redrawn from committed JSON: `python -m bench.sim_paper figures`)."""
from __future__ import annotations

import json
import math

from bench.sim_runs import OUT, R1_CONFIGS, R1_SLOS, R2_POLICIES, R3_TAUS, R4_TAUS, load

PAPER = {"r1_strict_sarathi_over_vllm": [2.15, 2.6],
         "note": "Sarathi-Serve (OSDI '24), Figure 10: Mistral-7B on one A100, strict SLO; the paper's headline "
                 "ratios are 2.6x (Mistral-7B, one A100), 3.7x (Yi-34B, two A100s), up to 5.6x (Falcon-180B, PP)"}


def _cap(name: str) -> float | None:
    p = OUT / f"{name}.json"
    return json.loads(p.read_text())["capacity_qps"] if p.is_file() else None


def _r1_name(slo: str, pol: str, tau: str) -> str:
    if pol != "sarathi":
        return f"r1_{slo}_{pol}"
    return f"r1_{slo}_sarathi_tau{tau}" if tau in ("512", "2048") else f"r3_{slo}_sarathi_tau{tau}"


def summary() -> dict:
    s: dict = {"paper": PAPER, "r1": {}, "r2": {}, "r3": {"tau_sweep": {}, "ablation": {}}, "r4": {}}
    for slo in R1_SLOS:
        row = {f"{p}" + (f"_tau{t}" if p == "sarathi" else ""): _cap(_r1_name(slo, p, t)) for p, t in R1_CONFIGS}
        v = row.get("vllm")
        row["ratios_over_vllm"] = {k: (c / v if c and v else None) for k, c in row.items() if k != "vllm"}
        s["r1"][slo] = row
    for slo in ("strict", "relaxed"):
        row = {p: _cap(f"r2_{slo}_{p}") for p, _ in R2_POLICIES}
        if (OUT / f"r2_{slo}_sarathi.json").is_file():
            row["tbt_slo_s"] = load(f"r2_{slo}_sarathi")["tbt_slo_s"]
        s["r2"][slo] = row
    for p, _ in R2_POLICIES:
        if (OUT / f"r2_bubbles_{p}.json").is_file():
            s["r2"][f"bubbles_{p}"] = {f"{r['qps']:g} QPS": {
                "pp_bubble_fraction": r["summary"]["pp_bubble_fraction"],
                "pp_idle_fraction": r["summary"].get("pp_idle_fraction"), "tbt_p99_s": r["summary"]["tbt_p99_s"],
                "ttft_p50_s": r["summary"]["ttft_p50_s"]} for r in load(f"r2_bubbles_{p}")["runs"]}
    for slo in R1_SLOS:
        s["r3"]["tau_sweep"][slo] = {t: _cap(_r1_name(slo, "sarathi", t)) for t in R3_TAUS}
    for p in ("sarathi", "hybrid_only", "chunked_only"):
        if (OUT / f"r3_ablation_{p}.json").is_file():
            r = load(f"r3_ablation_{p}")["runs"][0]["summary"]
            s["r3"]["ablation"][p] = {k: r[k] for k in ("ttft_p50_s", "tbt_p99_s", "tbt_p50_s", "finished")}
    s["r4"]["capacity"] = {t: _cap(f"r4_capacity_{t}") for t in R4_TAUS + ("adaptive",)}
    for p in sorted(OUT.glob("r4_windows_*.json")):
        r = json.loads(p.read_text())["runs"][0]
        s["r4"][p.stem] = {"qps": r["qps"], "tbt_p99_s": r["summary"]["tbt_p99_s"],
                           "windows_p99_s": [w["tbt_p99_s"] for w in r["summary"].get("windows", [])]}
    return s


def _finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else math.nan


def figures() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summary()
    (OUT / "summary.json").write_text(json.dumps(s, indent=1))
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    labels = [p + (f" {t}" if p == "sarathi" else "") for p, t in R1_CONFIGS]
    keys = [p + (f"_tau{t}" if p == "sarathi" else "") for p, t in R1_CONFIGS]
    for i, slo in enumerate(R1_SLOS):
        vals = [_finite(s["r1"][slo].get(k) or math.nan) for k in keys]
        ax.bar([j + 0.4 * i for j in range(len(keys))], vals, 0.4, label=f"{slo} ({R1_SLOS[slo]} s)")
    ax.set_xticks([j + 0.2 for j in range(len(keys))], labels, rotation=20)
    ax.set(ylabel="capacity (QPS)", title="r1: Llama-3-8B, 1x A100, ShareGPT (simulated)")
    ax.legend()
    ax = axes[1]
    for slo in R1_SLOS:
        sweep = s["r3"]["tau_sweep"][slo]
        ax.plot([int(t) for t in sweep], [_finite(v or math.nan) for v in sweep.values()], "o-", label=slo)
    ax.set(xscale="log", xlabel="token budget tau", ylabel="capacity (QPS)", title="r3: tau sweep (Fig. 9 shape)")
    ax.set_xticks([int(t) for t in R3_TAUS], list(R3_TAUS))
    ax.minorticks_off()
    ax.legend()
    ax = axes[2]
    row = s["r2"].get("strict", {})
    ax.bar([p for p, _ in R2_POLICIES], [_finite(row.get(p) or math.nan) for p, _ in R2_POLICIES],
           label="capacity, strict SLO")
    ax2 = ax.twinx()
    ax2.plot([p for p, _ in R2_POLICIES],
             [_finite(s["r2"].get(f"bubbles_{p}", {}).get("1 QPS", {}).get("pp_idle_fraction", math.nan))
              for p, _ in R2_POLICIES], "ro-", label="stage idle share at 1 QPS")
    ax2.set(ylabel="stage idle while busy", ylim=(0, 1))
    ax2.legend(loc="upper right")
    ax.set(ylabel="capacity (QPS)", title="r2: Llama-2-70B TP4-PP2 (8x A100)")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "results.png", dpi=110)
    plt.close(fig)

    wins = sorted(OUT.glob("r4_windows_*.json"))
    if wins:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for p in wins:
            r = json.loads(p.read_text())["runs"][0]["summary"]
            w = r.get("windows", [])
            axes[0].plot([(x["start"] + x["end"]) / 2 for x in w], [_finite(x["tbt_p99_s"]) for x in w], "o-",
                         label=p.stem.replace("r4_windows_", "tau "))
            if r.get("tau_history"):
                h = r["tau_history"]
                axes[1].step([x[0] for x in h], [x[1] for x in h], where="post", label="adaptive tau")
        axes[0].axhline(0.1, color="r", ls=":", label="SLO 100 ms")
        axes[0].set(xlabel="time (s)", ylabel="P99 TBT in the window (s)",
                    title="r4: prompts 4x longer from mid-run (arrivals)")
        axes[0].legend()
        axes[1].set(xlabel="time (s)", ylabel="tau (tokens)", title="the adaptive budget over time")
        fig.tight_layout()
        fig.savefig(OUT / "r4_adaptive.png", dpi=110)
        plt.close(fig)
    print(json.dumps(s, indent=1))
