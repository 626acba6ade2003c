"""Capacity of `sarathi serve` against llama.cpp's `llama-server`, from fixed-QPS HTTP runs.

Both servers are loaded by the same `sarathi bench --url` (bench/peer_run.sh: same trace,
length scale, seed, run length, SSE token times), at a few fixed QPS points each. One set of
points gives every condition at once, so each server is run once per configuration instead of
once per (SLO, condition) binary search:

* strict / relaxed: P99 TBT <= the profile's SLO (unfinished requests are misses);
* "+ TTFT": additionally P50 TTFT <= 2 s (over HTTP scheduling delay is not observable, so
  sarathi.measure.metrics.meets_slo skips that condition; the TTFT bound is its client-side stand-in).

capacity_from_points: the highest probed QPS at which this and every lower probed QPS pass
(a lower bound of the threshold, assuming pass/fail is monotone), with the bracket
[that QPS, the first failing QPS above it]. The true capacity lies in the bracket.

    python -m bench.peer_llama_server --sarathi-strict S.json [--sarathi-relaxed R.json] \
        --llama L.json --out bench/results/peer/peer_llama_server
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import machine
from sarathi.measure.metrics import json_safe, meets_slo

TTFT_P50_S = 2.0


def capacity_from_points(points: list[tuple[float, bool]]) -> dict:
    """points: (qps, ok) in any order. Returns {"capacity_qps", "bracket": [lo, hi]}: lo is the
    highest qps passing with every lower point passing (0.0 if the lowest fails), hi the first
    failing qps (None if all pass)."""
    if not points:
        raise ValueError("no QPS points")
    lo, hi = 0.0, None
    for q, ok in sorted(points):
        if not ok:
            hi = q
            break
        lo = q
    return {"capacity_qps": lo, "bracket": [lo, hi]}


def _load(path: str) -> dict:
    d = json.loads(Path(path).read_text())
    if "runs" not in d:
        raise ValueError(f"{path}: not a `sarathi bench` result (no 'runs')")
    return d


def analyse(runs_by_server: dict[str, dict[str, dict]], slos: dict[str, float]) -> dict:
    """runs_by_server[server][slo] = a `sarathi bench` result; returns capacities per server,
    SLO and condition, and the sarathi / llama-server ratios."""
    out: dict = {}
    for server, per_slo in runs_by_server.items():
        out[server] = {}
        for slo, tbt in slos.items():
            res = per_slo[slo]
            for cond, ttft in (("tbt", None), ("tbt+ttft", TTFT_P50_S)):
                pts = [(r["qps"], meets_slo(_unjson(r["summary"]), tbt, max_ttft_p50_s=ttft))
                       for r in res["runs"]]
                c = capacity_from_points(pts)
                c["points"] = [{"qps": q, "ok": ok} for q, ok in sorted(pts)]
                out[server][f"{slo}/{cond}"] = c
    ratios = {k: (out["sarathi"][k]["capacity_qps"] / out["llama-server"][k]["capacity_qps"]
                  if out["llama-server"][k]["capacity_qps"] > 0 else None)
              for k in out["sarathi"]}
    return {"capacity": out, "sarathi_over_llama_server": ratios}


def _unjson(s: dict) -> dict:
    return {k: (float(v) if v in ("inf", "-inf", "nan") else v) for k, v in s.items()}


def plot(result: dict, runs_by_server: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    styles = {"sarathi": "C0", "llama-server": "C3"}
    seen = set()
    for server, per_slo in runs_by_server.items():
        for slo, res in per_slo.items():
            key = id(res)
            if key in seen:
                continue
            seen.add(key)
            runs = sorted(res["runs"], key=lambda r: r["qps"])
            qs = [r["qps"] for r in runs]
            s = [_unjson(r["summary"]) for r in runs]
            label = server if server != "sarathi" or len(per_slo) == 1 or \
                per_slo["strict"] is per_slo["relaxed"] else f"sarathi ({slo} tau)"
            ls = "-" if slo == "strict" else "--"
            axes[0].plot(qs, [min(x["tbt_p99_s"], 60) for x in s], ls, marker="o", color=styles[server], label=label)
            axes[1].plot(qs, [min(x["ttft_p50_s"], 60) for x in s], ls, marker="o", color=styles[server], label=label)
            axes[2].plot(qs, [x["output_tok_per_s"] for x in s], ls, marker="o", color=styles[server], label=label)
    for name, v in result["slo"].items():
        axes[0].axhline(v, color="grey", lw=0.8, ls=":")
        axes[0].text(axes[0].get_xlim()[0], v, f" {name} {v:.2f} s", va="bottom", fontsize=7)
    axes[1].axhline(TTFT_P50_S, color="grey", lw=0.8, ls=":")
    axes[0].set(title="P99 TBT (inf clipped at 60 s)", xlabel="QPS", ylabel="s", yscale="log")
    axes[1].set(title="P50 TTFT (inf clipped at 60 s)", xlabel="QPS", ylabel="s", yscale="log")
    axes[2].set(title="output tokens/s", xlabel="QPS", ylabel="tok/s")
    for a in axes:
        a.legend(fontsize=7)
    caps = result["capacity"]
    txt = "; ".join(f"{k}: sarathi {caps['sarathi'][k]['capacity_qps']:g} / llama-server "
                    f"{caps['llama-server'][k]['capacity_qps']:g} QPS" for k in caps["sarathi"])
    fig.suptitle(f"sarathi serve vs llama-server, same HTTP load ({result['machine'].get('cpu', '')})\n{txt}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sarathi-strict", required=True, help="`sarathi bench --url` result, sarathi serve (strict tau)")
    p.add_argument("--sarathi-relaxed", help="the same with the relaxed plan's tau (default: --sarathi-strict)")
    p.add_argument("--llama", required=True, help="`sarathi bench --url` result, llama-server")
    p.add_argument("--profile", default="bench/results/paper/profile.json", help="SLOs from this profile")
    p.add_argument("--out", default="bench/results/peer/peer_llama_server")
    a = p.parse_args(argv)
    slos = {k: json.loads(Path(a.profile).read_text())["slo"][f"{k}_s"] for k in ("strict", "relaxed")}
    s_strict = _load(a.sarathi_strict)
    s_relaxed = _load(a.sarathi_relaxed) if a.sarathi_relaxed else s_strict
    llama = _load(a.llama)
    runs = {"sarathi": {"strict": s_strict, "relaxed": s_relaxed},
            "llama-server": {"strict": llama, "relaxed": llama}}
    result = analyse(runs, slos)
    result.update(command="python -m bench.peer_llama_server " + " ".join(sys.argv[1:] if argv is None else argv),
                  machine=machine(), slo=slos, ttft_p50_bound_s=TTFT_P50_S,
                  inputs={"sarathi_strict": a.sarathi_strict, "sarathi_relaxed": a.sarathi_relaxed or a.sarathi_strict,
                          "llama_server": a.llama},
                  run_commands={"sarathi_strict": s_strict.get("command"), "sarathi_relaxed": s_relaxed.get("command"),
                                "llama_server": llama.get("command")})
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps(json_safe(result), indent=1))
    plot(result, runs, out.with_suffix(".png"))
    for k in result["capacity"]["sarathi"]:
        s, l = result["capacity"]["sarathi"][k], result["capacity"]["llama-server"][k]
        r = result["sarathi_over_llama_server"][k]
        print(f"{k:18s} sarathi {s['capacity_qps']:g} {s['bracket']}  llama-server {l['capacity_qps']:g} "
              f"{l['bracket']}  ratio {'n/a' if r is None else f'{r:.2f}x'}")
    print(f"wrote {out.with_suffix('.json')} {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
