"""All linear layers of one SmolLM2-135M step (30 x qkv, o, gate_up, down + the LM head), float
vs weight-only int8, by token count T: where int8 pays (memory-bound, small T) and where the float
GEMM wins again (compute-bound). The result picks the int8 threshold recorded in
worker_svc/backends/cpu/quant.py (INT8_MAX_TOKENS).

Variants (each a full sweep over ~540 MB of fp32 weights, more than the L3, as in a real step):
* float32: F.linear (MKL/oneDNN sgemm);
* int8-native: worker_svc/backends/cpu/csrc/int8_linear.c (AVX2 widen-and-FMA, per-row scales);
* int8-torch: torch.ops.aten._weight_int8pack_mm, torch's own packed op (the issue's candidate);
  measured at small T only, it is slow on CPUs without AVX-512 (see the results);
* bfloat16: F.linear on bf16 weights and activations (oneDNN; fast where the CPU has AVX512_BF16
  or AMX): the large-batch path of worker_svc/backends/cpu/quant.py on such CPUs.
The thresholds: the largest T up to which int8-native beats each dense variant at every T.

Each round runs every (T, variant) once, variants of a T back to back; medians are reported.

    python -m bench.int8_linear [--rounds 5] [--threads 2] [--variants float32,int8-native,int8-torch,bfloat16]
                                [--sizes 1,2,4,...] [--out bench/results/kernels/int8_linear_amd]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import HIDDEN, INTER, layer_shapes, machine_line
from worker_svc.backends.cpu import native
from worker_svc.backends.cpu.quant import quantize_int8

SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128]
TORCH_INT8_SIZES = [1, 4, 16]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/kernels/int8_linear_amd")
    ap.add_argument("--variants", default="float32,int8-native,int8-torch,bfloat16")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    args = ap.parse_args(argv)
    wanted = args.variants.split(",")
    sizes = [int(t) for t in args.sizes.split(",")]
    if not native.available():
        sys.exit(f"native kernels unavailable: {native.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    layers = []
    for n, k in layer_shapes():
        w = torch.randn(n, k, generator=g) * 0.05
        q, s = quantize_int8(w)
        layers.append((w, q, s, (q.float() * s[:, None]).bfloat16() if "bfloat16" in wanted else None))
    fp32_bytes = sum(w.numel() * 4 for w, *_ in layers)
    int8_bytes = sum(q.numel() + s.numel() * 4 for _, q, s, _ in layers)
    xs = {t: {k: torch.randn(t, k, generator=g) for k in (HIDDEN, INTER)} for t in sizes}
    xb = {t: {k: x.bfloat16() for k, x in d.items()} for t, d in xs.items()}

    def sweep(variant: str, t: int) -> float:
        t0 = time.perf_counter()
        for w, q, s, wb in layers:
            x = xs[t][w.shape[1]]
            if variant == "float32":
                F.linear(x, w)
            elif variant == "int8-native":
                native.int8_linear(x, q, s)
            elif variant == "bfloat16":
                F.linear(xb[t][w.shape[1]], wb)
            else:
                torch.ops.aten._weight_int8pack_mm(x, q, s)
        return time.perf_counter() - t0

    variants = {t: [v for v in wanted if v != "int8-torch" or t in TORCH_INT8_SIZES] for t in sizes}
    times = {(t, v): [] for t in sizes for v in variants[t]}
    for t in sizes:                     # warm-up (page faults, oneDNN primitive caches)
        for v in variants[t]:
            sweep(v, t)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    for r in range(args.rounds):
        for t in sizes:
            for v in variants[t]:
                if v == "int8-torch" and r > 1:
                    continue            # slow; two rounds are enough to show it
                times[(t, v)].append(sweep(v, t))
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    rows = []
    for (t, v), ts in times.items():
        med = statistics.median(ts)
        nbytes = {"float32": fp32_bytes, "bfloat16": fp32_bytes // 2}.get(v, int8_bytes)
        rows.append({"tokens": t, "variant": v, "median_ms": round(med * 1e3, 3),
                     "min_ms": round(min(ts) * 1e3, 3), "weight_gb_per_s": round(nbytes / med / 1e9, 2),
                     "samples_ms": [round(x * 1e3, 3) for x in ts]})
    med = {(r["tokens"], r["variant"]): r["median_ms"] for r in rows}

    def threshold(dense: str) -> int:
        wins = [t for t in sizes if med[(t, "int8-native")] < med[(t, dense)]]
        return max((t for t in wins if all(u in wins for u in sizes if u <= t)), default=0)

    thresholds = {d: threshold(d) for d in ("float32", "bfloat16") if d in wanted and "int8-native" in wanted}
    crossover = thresholds.get("float32", 0)
    result = {
        "command": "python -m bench.int8_linear " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_line(), "torch": torch.__version__, "threads": args.threads,
        "int8_kernel_isa": native.int8_isa(),
        "loadavg_before_after": [load_before, Path("/proc/loadavg").read_text().split()[:3]],
        "weights_fp32_mb": round(fp32_bytes / 1e6, 1), "weights_int8_mb": round(int8_bytes / 1e6, 1),
        "int8_faster_up_to_tokens": crossover, "int8_faster_than_dense_up_to_tokens": thresholds,
        "results": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in wanted:
        pts = sorted((r["tokens"], r["median_ms"]) for r in rows if r["variant"] == v)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=v)
    for d, c in thresholds.items():
        ax.axvline(c, ls=":", color="gray" if d == "float32" else "k", label=f"int8 faster than {d} up to T={c}")
    ax.set(xscale="log", yscale="log", xlabel="tokens in the batch (T)",
           ylabel="all linear layers of one step (ms, median)",
           title=f"SmolLM2-135M linear layers, {args.threads} threads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    for r in sorted(rows, key=lambda r: (r["tokens"], r["variant"])):
        print(f"T={r['tokens']:4d} {r['variant']:12s} {r['median_ms']:9.2f} ms  {r['weight_gb_per_s']:6.1f} GB/s")
    print(f"int8 faster than the dense path up to: {thresholds}")


if __name__ == "__main__":
    main()
