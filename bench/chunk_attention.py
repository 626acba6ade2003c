"""Prefill-chunk attention: the native chunk kernel (csrc/chunk_attention.c) against the torch path
it replaced (worker_svc.backends.torch_attention: gather, widen, repeat K/V per query head, SDPA).

Part "kernel": one layer's attention of one chunk on SmolLM2's shapes (9 query heads, 3 kv heads,
head dim 64, bf16 cache in blocks of 16, scattered), for chunks of n tokens after a cached
prefix of `start` tokens; both paths in turn each round, medians over rounds.
Part "engine": SmolLM2's GGUF on the ModelRunner, prefill steps (512 and 128 tokens), one engine
process with the kernel and one with SARATHI_NATIVE_CHUNK=0, stepped in turn (ABBA), in two
sessions of opposite start order (bench.common.start_order_sessions); the paired statistic is the
median over rounds of the per-round ratio kernel / SDPA.

Which instruction set both run is the caller's: the defaults take this CPU's best kernel variant and
torch's own dispatch; for an AVX2 machine's engine on a newer CPU set SARATHI_NATIVE_VARIANT=avx2
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 (recorded in the JSON).

    python -m bench.chunk_attention [--rounds 9] [--threads 2] [--out bench/results/kernels/chunk_attention]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import EngineProcess, start_order_sessions
from bench.gguf_kernels import cpu_id, pressure

HQ, HKV, DIM, BS = 9, 3, 64, 16
KERNEL_CASES = [(512, 0), (128, 384), (512, 1536), (64, 4032)]     # (chunk tokens, cached prefix)
ENGINE_CASES = ["prefill:512", "prefill:128"]
ENV_KEYS = ("SARATHI_NATIVE_VARIANT", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def kernel_case(n: int, start: int, seed: int = 0):
    from worker_svc.backends.torch_attention import ChunkMeta

    g = torch.Generator().manual_seed(seed)
    nb = -(-(start + n) // BS)
    kc = torch.randn(2 * nb, BS, HKV, DIM, generator=g).bfloat16()
    vc = torch.randn(2 * nb, BS, HKV, DIM, generator=g).bfloat16()
    table = torch.randperm(2 * nb, generator=g)[:nb]
    q = torch.randn(n, HQ, DIM, generator=g)
    return q, kc, vc, table.to(torch.int32), ChunkMeta(0, n, start, table.long())


def bench_kernel(rounds: int) -> dict:
    from worker_svc.backends import torch_attention as ta
    from worker_svc.backends.cpu import native

    res = {}
    for n, start in KERNEL_CASES:
        q, kc, vc, table, meta = kernel_case(n, start)
        out_k, out_t = torch.empty_like(q), torch.empty_like(q)
        fns = {"kernel": lambda: native.chunk_attention(q, kc, vc, table, start, DIM ** -0.5, out_k, check=False),
               "sdpa": lambda: ta._chunk_attention(q, kc, vc, meta, out_t, DIM ** -0.5)}
        times = {k: [] for k in fns}
        for f in fns.values():
            f()
        for r in range(rounds):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                t0 = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - t0)
        ms = {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()}
        res[f"{n}@{start}"] = {**ms, "sdpa_over_kernel": round(ms["sdpa"] / ms["kernel"], 3),
                               "max_abs_diff": float((out_k - out_t).abs().max())}
        print(f"chunk {n} after {start}: {res[f'{n}@{start}']}", file=sys.stderr, flush=True)
    return res


def bench_engine(rounds: int, threads: int) -> dict:
    tree = Path(__file__).resolve().parent.parent
    arms = {"kernel": {}, "sdpa": {"SARATHI_NATIVE_CHUNK": "0"}}
    times = {name: {c: [] for c in ENGINE_CASES} for name in arms}
    backends, done = {}, 0
    for order, n in start_order_sessions(list(arms), rounds):
        procs = {name: EngineProcess(tree, threads, "float32:auto:auto", env=arms[name]) for name in order}
        for c in ENGINE_CASES:
            for p in procs.values():
                p.step(c)
        for r in range(n):
            for name in (list(procs) if r % 2 == 0 else list(procs)[::-1]):
                for c in ENGINE_CASES:
                    times[name][c].append(statistics.median(procs[name].step(c)["s"] for _ in range(2)))
            done += 1
            print(f"round {done}/{rounds}: " + "; ".join(
                f"{a} {1e3 * times[a]['prefill:512'][-1]:.0f} ms" for a in procs), file=sys.stderr, flush=True)
        backends.update({name: p.info["ready"] for name, p in procs.items()})
        for p in procs.values():
            p.close()
    out = {"ms": {n: {c: round(1e3 * statistics.median(v), 2) for c, v in d.items()} for n, d in times.items()},
           "rounds_ms": {n: {c: [round(1e3 * t, 2) for t in v] for c, v in d.items()} for n, d in times.items()},
           "backends": backends}
    out["kernel_over_sdpa"] = {}
    for c in ENGINE_CASES:
        r = [a / b for a, b in zip(times["kernel"][c], times["sdpa"][c])]
        out["kernel_over_sdpa"][c] = {"median": round(statistics.median(r), 3), "min": round(min(r), 3),
                                      "max": round(max(r), 3)}
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    cases = list(res["kernel"])
    x = range(len(cases))
    a.bar([i - 0.2 for i in x], [res["kernel"][c]["sdpa"] for c in cases], 0.4, label="torch SDPA path")
    a.bar([i + 0.2 for i in x], [res["kernel"][c]["kernel"] for c in cases], 0.4, label="chunk kernel")
    a.set_xticks(list(x), [c.replace("@", " after ") for c in cases], fontsize=8)
    a.set_ylabel("ms per layer (lower is better)")
    a.set_title("one layer's chunk attention (tokens after cached prefix)", fontsize=9)
    a.legend(fontsize=8)
    e = res["engine"]["ms"]
    b.bar([i - 0.2 for i in range(len(ENGINE_CASES))], [e["sdpa"][c] for c in ENGINE_CASES], 0.4, label="SDPA")
    b.bar([i + 0.2 for i in range(len(ENGINE_CASES))], [e["kernel"][c] for c in ENGINE_CASES], 0.4, label="kernel")
    for i, c in enumerate(ENGINE_CASES):
        b.text(i + 0.2, e["kernel"][c], f" {res['engine']['kernel_over_sdpa'][c]['median']:.3f}x", fontsize=8,
               ha="center", va="bottom")
    b.set_xticks(range(len(ENGINE_CASES)), ENGINE_CASES)
    b.set_ylabel("ms per step")
    b.set_title("SmolLM2 GGUF prefill step (paired ratio kernel / SDPA)", fontsize=9)
    b.legend(fontsize=8)
    fig.suptitle(f"{res['machine']}, {res['threads']} threads, {res['date'][:16]}; {res['isa']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/kernels/chunk_attention"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from worker_svc.backends.cpu import native

    res = {"command": "python -m bench.chunk_attention " + " ".join(sys.argv[1:] if argv is None else argv),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": cpu_id(), "threads": args.threads, "pressure_before": pressure(),
           "environment": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
           "isa": f"kernel {native.isa()}, torch {torch.backends.cpu.get_cpu_capability()}",
           "shapes": {"q_heads": HQ, "kv_heads": HKV, "head_dim": DIM, "block_size": BS, "kv": "bfloat16"}}
    res["kernel"] = bench_kernel(args.rounds)
    res["engine"] = bench_engine(args.rounds, args.threads)
    res["pressure_after"] = pressure()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    plot(res, args.out.with_suffix(".png"))
    print(json.dumps({k: res[k] for k in ("kernel",)}, indent=1))
    print(json.dumps(res["engine"]["kernel_over_sdpa"], indent=1))


if __name__ == "__main__":
    main()
