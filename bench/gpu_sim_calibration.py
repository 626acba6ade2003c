"""The simulator's GPU cost model against measured GPU iterations: its error, and a fitted host term.

    python -m bench.gpu_sim_calibration RUN.json [RUN.json ...] [--device h200]
                                        [--out bench/results/gpu/gpu_sim_calibration]

RUN.json: what bench.gpu_load_point wrote on a GPU; every real iteration there has its exact
batch shapes (each sequence's start, new tokens, decode or not) and its measured seconds. For each
run and policy this evaluates `GPUCostModel(llama-3-8b, --device)` on those shapes and reports
predicted / measured per iteration (P10, P50, P90, and the median absolute error).

The model's GPU terms come from A100 operator profiles scaled by roofline and from attention
efficiencies; its host term (cpu_fixed_s + cpu_per_seq_s x sequences per iteration) is an
assumption. The calibration keeps the GPU terms and fits the host term to the measurements by
least squares (what the real engine's Python, launches and synchronisation cost per iteration on
that host), then reports the error again with the fitted term. Writes <out>.json and <out>.png
(predicted vs measured iteration time, before and after the fit).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

from sarathi.measure.gpu_costmodel import GPUCostModel


def load_runs(paths: list[Path]) -> list[dict]:
    """[{label, gpu, backend, policy, shapes: [[(start, n, decode)]], seconds: [s]}]; a run's
    label is its file's name, with its folder's when two files share a name."""
    out = []
    stems = [p.stem for p in paths]
    for p in paths:
        name = p.stem if stems.count(p.stem) == 1 else f"{p.parent.name}/{p.stem}"
        d = json.loads(p.read_text())
        for policy, entry in d["policies"].items():
            batches = entry["real"].get("batches")
            if not batches:
                continue
            out.append({"label": f"{name}:{policy}", "gpu": d["gpu"], "backend": d["backend"],
                        "policy": policy, "shapes": [[tuple(s) for s in b[0]] for b in batches],
                        "seconds": [b[1] for b in batches]})
    if not out:
        raise SystemExit("gpu_sim_calibration: no run with per-iteration batches in the given files")
    return out


def ratios(pred: np.ndarray, real: np.ndarray) -> dict:
    r = np.sort(pred / real)
    n = len(r)
    return {"iterations": n, "pred_over_real_p10": float(r[n // 10]), "pred_over_real_p50": float(np.median(r)),
            "pred_over_real_p90": float(r[9 * n // 10]),
            "median_abs_error": float(np.median(np.abs(pred / real - 1)))}


def calibrate(runs: list[dict], device: str) -> dict:
    model = GPUCostModel("llama-3-8b", device)
    host = model.cpu_fixed_s, model.cpu_per_seq_s
    result = {"device_model": device, "assumed_host": {"cpu_fixed_s": host[0], "cpu_per_seq_s": host[1]}, "runs": {}}
    for run in runs:
        real = np.array(run["seconds"])
        pred = np.array([model.predict_shapes(s) for s in run["shapes"]])
        seqs = np.array([len(s) for s in run["shapes"]], dtype=float)
        gpu = pred - (host[0] + host[1] * seqs)                 # the model's GPU terms alone
        # real - gpu = a + b * seqs (least squares, a and b >= 0)
        a_mat = np.stack([np.ones_like(seqs), seqs], axis=1)
        (a, b), *_ = np.linalg.lstsq(a_mat, real - gpu, rcond=None)
        a, b = max(float(a), 0.0), max(float(b), 0.0)
        fitted = gpu + a + b * seqs
        result["runs"][run["label"]] = {
            "gpu": run["gpu"], "backend": run["backend"], "policy": run["policy"],
            "as_assumed": ratios(pred, real),
            "fitted_host": {"cpu_fixed_s": a, "cpu_per_seq_s": b, **ratios(fitted, real)},
            "real_p50_s": float(np.median(real)),
            "_points": (real, pred, fitted)}
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(4.6 * len(runs), 4.2), squeeze=False)
    for ax, (label, r) in zip(axes[0], runs.items()):
        real, pred, fitted = r["_points"]
        ax.scatter(real * 1e3, pred * 1e3, s=4, alpha=0.35, label="model as assumed")
        ax.scatter(real * 1e3, fitted * 1e3, s=4, alpha=0.35, label="host term fitted")
        lim = [0, max(real.max(), pred.max(), fitted.max()) * 1e3 * 1.05]
        ax.plot(lim, lim, "k--", lw=0.8)
        ax.set(xlim=lim, ylim=lim, xlabel="measured iteration (ms)", ylabel="predicted (ms)",
               title=f"{label}\nP50 error {r['as_assumed']['median_abs_error']:.0%} -> "
                     f"{r['fitted_host']['median_abs_error']:.0%}")
        ax.title.set_fontsize(8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, markerscale=3)
    fig.suptitle(f"simulator ({result['device_model']} model, Llama-3-8B) vs measured iterations", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="gpu_load_point JSON files")
    ap.add_argument("--device", default="h200", help="the simulator's device model (a100, h100, h200)")
    ap.add_argument("--out", default="bench/results/gpu/gpu_sim_calibration")
    args = ap.parse_args(argv)
    result = calibrate(load_runs(args.runs), args.device)
    result["command"] = "python -m bench.gpu_sim_calibration " + " ".join(sys.argv[1:] if argv is None else argv)
    result["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(result, out.with_suffix(".png"))
    for label, r in result["runs"].items():
        del r["_points"]
        a, f = r["as_assumed"], r["fitted_host"]
        print(f"{label}: predicted/measured P50 {a['pred_over_real_p50']:.2f} (P10 {a['pred_over_real_p10']:.2f}, "
              f"P90 {a['pred_over_real_p90']:.2f}); host fitted {f['cpu_fixed_s'] * 1e3:.2f} ms + "
              f"{f['cpu_per_seq_s'] * 1e6:.1f} us/seq -> P50 {f['pred_over_real_p50']:.2f}, "
              f"median |error| {f['median_abs_error']:.1%}")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
