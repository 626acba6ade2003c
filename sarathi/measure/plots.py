"""PNG figures of the measurement tools (matplotlib, Agg). Each function takes the result dict
the tool writes as JSON, so a figure can be redrawn from a committed result."""
from __future__ import annotations

import math
from pathlib import Path


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else math.nan


def plot_run(result: dict, path: Path) -> None:
    """One or more bench runs: iteration timeline of the first, TBT/TTFT against QPS if several."""
    plt = _plt()
    runs = result["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    its = runs[0].get("iterations") or []
    ax = axes[0]
    if its:
        sc = ax.scatter([i["start"] for i in its], [i["duration"] * 1e3 for i in its], s=6,
                        c=[i["prefill_tokens"] for i in its], cmap="viridis")
        fig.colorbar(sc, ax=ax, label="prefill tokens in the iteration")
        ax.set(xlabel="time since start (s)", ylabel="iteration time (ms)",
               title=f"iterations at {runs[0]['qps']:g} QPS")
    elif runs[0].get("requests"):
        gaps = sorted(g for r in runs[0]["requests"] for g in _gaps(r["token_times"]))
        if gaps:
            ax.plot([g * 1e3 for g in gaps], [(i + 1) / len(gaps) for i in range(len(gaps))])
        ax.set(xlabel="token gap (ms)", ylabel="CDF", title=f"TBT CDF at {runs[0]['qps']:g} QPS")
    ax.grid(alpha=0.3)
    ax = axes[1]
    qps = [r["qps"] for r in runs]
    ax.plot(qps, [_finite(r["summary"]["tbt_p99_s"]) for r in runs], "o-", label="P99 TBT")
    ax.plot(qps, [_finite(r["summary"]["ttft_p50_s"]) for r in runs], "s--", label="P50 TTFT")
    if result.get("tbt_slo_s"):
        ax.axhline(result["tbt_slo_s"], color="r", ls=":", label="TBT SLO")
    ax.set(xlabel="QPS", ylabel="seconds", yscale="log", title="latency against load")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gaps(times):
    return [b - a for a, b in zip(times, times[1:])]


def plot_capacity(result: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    probes = result["probes"]
    for ok, marker, label in ((True, "o", "meets SLO"), (False, "x", "misses SLO")):
        pts = [p for p in probes if p["ok"] == ok]
        ax.scatter([p["qps"] for p in pts], [_finite(p["summary"]["tbt_p99_s"]) for p in pts],
                   marker=marker, label=label)
    ax.axhline(result["tbt_slo_s"], color="r", ls=":", label=f"TBT SLO {result['tbt_slo_s']:.3g} s")
    ax.axvline(result["capacity_qps"], color="g", ls="--",
               label=f"capacity {result['capacity_qps']:.3g} QPS")
    ax.set(xlabel="QPS", ylabel="P99 TBT (s; missing = inf)", yscale="log",
           title=f"capacity search: {result.get('label', '')}")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_profile(result: dict, path: Path) -> None:
    plt = _plt()
    pts = result["points"]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    labels = [_label(p) for p in pts]
    x = range(len(pts))
    ax.bar([i - 0.2 for i in x], [p["seconds"] * 1e3 for p in pts], 0.4, label="measured (median)")
    ax.bar([i + 0.2 for i in x], [p["model_s"] * 1e3 for p in pts], 0.4, label="cost model")
    for name in ("strict_s", "relaxed_s"):
        ax.axhline(result["slo"][name] * 1e3, ls=":", color="r" if name == "strict_s" else "m",
                   label=f"{name[:-2]} SLO {result['slo'][name] * 1e3:.0f} ms")
    ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=8)
    ax.set(ylabel="iteration time (ms)", yscale="log", title="iteration-time profile")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label(p: dict) -> str:
    if p["kind"] == "decode":
        return f"decode B={p['batch']} @{p['context']}" + (" ragged" if p.get("ragged") else "")
    if p["kind"] == "prefill":
        return (f"{p['prompts']}x " if p.get("prompts") else "") + f"prefill {p['tokens']}" + (
            f" @{p['prefix']}" if p["prefix"] else "")
    return f"{p['decodes']} dec @{p['context']} + {p['tokens']}" + (f" @{p['prefix']}" if p.get("prefix") else "")


def plot_plan(result: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    curve = result["curve"]
    ax.plot([c["tau"] for c in curve], [c["iteration_s"] for c in curve], ".-",
            label="predicted hybrid iteration")
    ax.axhline(result["tbt_slo_s"], color="r", ls=":", label="TBT SLO")
    ax.axvline(result["token_budget"], color="g", ls="--", label=f"tau = {result['token_budget']}")
    d = result.get("disagg")
    if d:
        top = 1.5 * result["tbt_slo_s"]
        pts = [c for c in d["curve"] if c["iteration_s"] <= top] or d["curve"][:1]
        ax.plot([c["prompt"] for c in pts], [c["iteration_s"] for c in pts], ".-", color="tab:purple",
                label="decodes + a whole prompt of x tokens")
        xfer = (f", KV {d['kv_transfer_s'] * 1e3:.1f} ms @ {d['kv_link_gbs']:g} GB/s"
                if d.get("kv_transfer_s") is not None else "")
        ax.axvline(d["disagg_threshold"], color="tab:purple", ls="--",
                   label=f"disagg threshold = {d['disagg_threshold']}{xfer}")
    ax.set(xlabel="token budget tau / prompt length (tokens)", ylabel="seconds",
           title=f"{result['decode_batch']} decodes @{result['context']} + chunk")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
