"""The int8 linear kernel's software prefetch (worker_svc/backends/cpu/csrc/int8_linear.c: PREFETCH_TILES,
PREFETCH_HINT), A/B in one run: each variant is the same source built with other -D values,
timed over all linear layers of one SmolLM2-135M step (163 MB of int8 weights, more than the
L3), variants interleaved per round, medians of --rounds.

    python -m bench.int8_prefetch [--threads 2] [--sizes 1,2,8] [--rounds 7] \
        [--out bench/results/kernels/int8_prefetch_zen4]
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.common import layer_shapes, machine_line

SOURCE = Path(__file__).resolve().parent.parent / "worker_svc" / "backends" / "cpu" / "csrc" / "int8_linear.c"
VARIANTS = {
    "L1 x4 (before)": ["-DPREFETCH_TILES=4", "-DPREFETCH_HINT=_MM_HINT_T0"],
    "none": ["-DPREFETCH_TILES=0"],
    "L2 x4": ["-DPREFETCH_TILES=4", "-DPREFETCH_HINT=_MM_HINT_T1"],
    "L2 x8 (default)": [],
    "L2 x16": ["-DPREFETCH_TILES=16", "-DPREFETCH_HINT=_MM_HINT_T1"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="1,2,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="bench/results/kernels/int8_prefetch_zen4")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="int8_prefetch_"))
    libs = {}
    for i, (name, defs) in enumerate(VARIANTS.items()):
        so = tmp / f"v{i}.so"
        subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *defs, "-o", str(so),
                        str(SOURCE)], check=True)
        lib = ctypes.CDLL(str(so))
        P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.int8_linear.argtypes = [P, L, P, P, P, P, L, I, I, I, I]
        libs[name] = lib
    g = torch.Generator().manual_seed(0)
    ws = [torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g) for n, k in layer_shapes()]
    scales = [torch.rand(n, generator=g) + 0.5 for n, _ in layer_shapes()]
    nbytes = sum(w.numel() for w in ws)
    rows = []
    for T in map(int, args.sizes.split(",")):
        xs = [torch.randn(T, w.shape[1], generator=g) for w in ws]
        outs = [torch.empty(T, w.shape[0]) for w in ws]
        times = {n: [] for n in libs}
        for _ in range(args.rounds + 1):        # the first round warms up
            for name, lib in libs.items():
                t0 = time.perf_counter()
                for x, w, s, o in zip(xs, ws, scales, outs):
                    lib.int8_linear(x.data_ptr(), x.stride(0), w.data_ptr(), s.data_ptr(), None, o.data_ptr(),
                                    o.stride(0), T, w.shape[0], w.shape[1], args.threads)
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            med = statistics.median(ts[1:])
            rows.append({"tokens": T, "variant": name, "median_ms": round(med * 1e3, 2),
                         "weight_gb_per_s": round(nbytes / med / 1e9, 2)})
            print(f"T={T} {name:16s} {med * 1e3:7.2f} ms {nbytes / med / 1e9:5.1f} GB/s", flush=True)
    result = {"command": "python -m bench.int8_prefetch " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_line(), "threads": args.threads, "variants": VARIANTS,
              "loadavg": Path("/proc/loadavg").read_text().split()[:3], "results": rows}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    sizes = sorted({r["tokens"] for r in rows})
    for i, name in enumerate(VARIANTS):
        ax.bar([j + (i - 2) * 0.16 for j in range(len(sizes))],
               [next(r["median_ms"] for r in rows if r["tokens"] == t and r["variant"] == name) for t in sizes],
               0.16, label=name)
    ax.set_xticks(range(len(sizes)), [f"T={t}" for t in sizes])
    ax.set(ylabel="all linear layers of a step (ms)", title=f"int8 kernel prefetch, {args.threads} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
