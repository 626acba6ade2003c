"""Decode attention alone: the native paged kernel (worker_svc/backends/cpu/native.py) vs the torch path
(worker_svc.backends.torch_attention: sort, group, index_select gather, SDPA) on SmolLM2's shapes.

SmolLM2-135M: 9 query heads, 3 kv heads, head_dim 64, block size 16. Each case is B decodes at
one context length; q/out have the cache's dtype (fp32 for an fp16 cache), as in the engine. The timed unit is one
layer's decode attention; a pass runs it over L distinct layer caches (views of one allocation,
1 GiB in all, like the engine's 30 layers interleaved with weight reads) so K/V come from
DRAM, not from the 260 MiB L3 (L is capped at 256, so the smallest cases, B = 1 and 8 at
context 128, stay partly cache-resident). Block tables are a random permutation of the blocks (a server
that has run a while); the KV values are random.

Each round times one pass of every variant back to back (torch then native, per thread count),
so background load on this shared machine hits both alike; medians over rounds are reported
and the speedup is the ratio of the two medians.

--baseline REV also times the kernel of git revision REV (paged_decode.c built beside this one,
with native.py's flags: SARATHI_NATIVE_MARCH=znver3 A/Bs the AVX2 path on an AVX-512 machine;
both kernels then called the same way, without the wrapper's checks, in alternating order), and
"read": a plain AVX2 read of the same K/V blocks in block-table order (16-bit
caches only), the memory bound for this access pattern on one thread.

    python -m bench.attention_kernel [--rounds 7] [--threads 1,2] [--baseline HEAD~1] \
        [--out bench/results/kernels/attention_kernel.json]
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import kernel_sources_at, machine_line
from worker_svc.backends import torch_attention as attention
from worker_svc.backends.cpu import native

HQ, HKV, DIM, BS = 9, 3, 64, 16
SIZES = [1, 8, 32, 128]
CONTEXTS = [1024, 128]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TARGET_BYTES = 1 << 30          # K+V bytes a pass walks through (> L3)
MAX_LAYERS = 256


def make_case(batch: int, ctx: int, dtype: torch.dtype, seed: int = 0):
    """(layers [(k, v)], q, tables int32 [B, nb], lens int32 [B], meta for the torch path)."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-ctx // BS)
    blocks = batch * nb
    layer_bytes = 2 * blocks * BS * HKV * DIM * torch.tensor([], dtype=dtype).element_size()
    num_layers = max(2, min(MAX_LAYERS, -(-TARGET_BYTES // layer_bytes)))
    shape = (num_layers, 2, blocks, BS, HKV, DIM)
    kv = torch.empty(shape, dtype=dtype)
    for layer in range(num_layers):                     # filled per layer: bounded temp memory
        kv[layer].copy_(torch.randn(shape[1:], generator=g))
    layers = [(kv[i, 0], kv[i, 1]) for i in range(num_layers)]
    tables = torch.randperm(blocks, generator=g).view(batch, nb).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    # fp16 is a KV-cache-only dtype: the engine's q/out are then fp32
    q = torch.randn(batch, HQ, DIM, generator=g).to(torch.float32 if dtype == torch.float16 else dtype)
    # the engine's metadata: every decode has start_pos ctx - 1 and one new token
    meta = attention.build_metadata([(ctx - 1, 1, t.tolist()) for t in tables], BS)
    return layers, q, tables, lens, meta


def torch_pass(layers, q, meta, out, scale) -> None:
    for kc, vc in layers:
        for group in meta.decodes:
            attention._decode_attention(q, kc, vc, group, out, scale)


def native_pass(layers, q, tables, lens, out, scale) -> None:
    for kc, vc in layers:
        native.paged_decode_attention(q, kc, vc, tables, lens, scale, out)


def native_threads(threads: int, kv_bytes: int) -> int:
    """The kernel's own cap (MIN_BYTES_PER_THREAD in paged_decode.c): one thread per 256 KiB of K/V."""
    return min(threads, 1 + kv_bytes // (256 << 10))


READ_C = r"""
#include <immintrin.h>
#include <stdint.h>
/* sum of every 16-bit K and V element of the tables' blocks (widened like bf16): a plain read */
float read_blocks(const uint16_t *kc, const uint16_t *vc, const int32_t *tab, int n, int64_t blk) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    for (int i = 0; i < n; i++) {
        const uint16_t *k = kc + tab[i] * blk, *v = vc + tab[i] * blk;
        for (int64_t e = 0; e < blk; e += 16) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(k + e)), y = _mm256_loadu_si256((const __m256i *)(v + e));
            s0 = _mm256_add_ps(s0, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
            s1 = _mm256_add_ps(s1, _mm256_castsi256_ps(_mm256_slli_epi32(y, 16)));
        }
    }
    float f[8];
    _mm256_storeu_ps(f, _mm256_add_ps(s0, s1));
    return f[0];
}
"""


def build_extra(baseline: str | None) -> tuple[ctypes.CDLL | None, ctypes.CDLL]:
    """(the baseline revision's kernel or None, the read_blocks library), in a temp dir."""
    tmp = Path(tempfile.mkdtemp(prefix="attn_bench_"))
    base = None
    if baseline:
        src = kernel_sources_at(baseline, tmp / "csrc") / "paged_decode.c"   # with the headers it includes
        subprocess.run([native._compiler(), *native._flags(), "-o", str(tmp / "base.so"), str(src), "-lm"],
                       check=True)   # the flags native.py builds with ($SARATHI_NATIVE_MARCH included)
        base = ctypes.CDLL(str(tmp / "base.so"))
        P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        base.paged_decode_attention.argtypes = [P, I, L, P, P, I, P, I, P, P, I, I, I, I, I,
                                                ctypes.c_float, P, I, L, I]
    (tmp / "read.c").write_text(READ_C)
    subprocess.run(["gcc", "-O3", "-mavx2", "-shared", "-fPIC", "-o", str(tmp / "read.so"),
                    str(tmp / "read.c")], check=True)
    rd = ctypes.CDLL(str(tmp / "read.so"))
    rd.read_blocks.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    rd.read_blocks.restype = ctypes.c_float
    return base, rd


DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # paged_decode.c's dtype codes


def raw_pass(fn, layers, q, tables, lens, out, scale, threads, *extra) -> None:
    """fn (a kernel library's paged_decode_attention, or _split with extra = (0,)) over every
    layer's cache, called through ctypes with no checks."""
    for kc, vc in layers:
        fn(q.data_ptr(), DTYPE_CODE[q.dtype], q.stride(0), kc.data_ptr(), vc.data_ptr(), DTYPE_CODE[kc.dtype],
           tables.data_ptr(), tables.shape[1], lens.data_ptr(), None, tables.shape[0], HQ, HKV, DIM, BS, scale,
           out.data_ptr(), DTYPE_CODE[out.dtype], out.stride(0), threads, *extra)


def raw_native_pass(layers, q, tables, lens, out, scale, threads) -> None:
    """native_pass without the wrapper's checks: the call baseline_pass makes, so that the two
    kernels are compared at the same call cost (the checks cost microseconds a call, several
    percent of one decode's layer)."""
    raw_pass(native._lib.paged_decode_attention_split, layers, q, tables, lens, out, scale, threads, 0)


def baseline_pass(lib, layers, q, tables, lens, out, scale, threads) -> None:
    raw_pass(lib.paged_decode_attention, layers, q, tables, lens, out, scale, threads)


def read_pass(rd, layers, tables) -> None:
    for kc, vc in layers:
        rd.read_blocks(kc.data_ptr(), vc.data_ptr(), tables.data_ptr(), tables.numel(), BS * HKV * DIM)


def run_case(batch: int, ctx: int, dtype_name: str, threads: list[int], rounds: int,
             base=None, rd=None) -> list[dict]:
    dtype = DTYPES[dtype_name]
    layers, q, tables, lens, meta = make_case(batch, ctx, dtype)
    scale = 1 / math.sqrt(DIM)
    out_t, out_n = torch.empty_like(q), torch.empty_like(q)
    for t in threads:                                   # warm-up, and a sanity check of the result
        torch.set_num_threads(t)
        torch_pass(layers, q, meta, out_t, scale)
        native_pass(layers, q, tables, lens, out_n, scale)
    diff = (out_t.float() - out_n.float()).abs().max().item()
    variants = (["torch", "native"] + (["baseline"] if base else [])
                + (["read"] if rd and dtype != torch.float32 else []))
    out_b = torch.empty_like(q)
    if base:
        baseline_pass(base, layers, q, tables, lens, out_b, scale, threads[0])
        diff_b = (out_b.float() - out_n.float()).abs().max().item()
    times = {(t, v): [] for t in threads for v in variants}
    for r in range(rounds):
        for t in threads:
            torch.set_num_threads(t)
            order = variants if r % 2 == 0 or not base else \
                [{"native": "baseline", "baseline": "native"}.get(v, v) for v in variants]
            for v in order:
                t0 = time.perf_counter()
                if v == "torch":
                    torch_pass(layers, q, meta, out_t, scale)
                elif v == "native" and base:   # the baseline's call cost, and every other round first
                    raw_native_pass(layers, q, tables, lens, out_n, scale, t)
                elif v == "native":
                    native_pass(layers, q, tables, lens, out_n, scale)
                elif v == "baseline":
                    baseline_pass(base, layers, q, tables, lens, out_b, scale, t)
                else:
                    read_pass(rd, layers, tables)
                times[(t, v)].append((time.perf_counter() - t0) / len(layers))
    kv_bytes = 2 * batch * ctx * HKV * DIM * layers[0][0].element_size()
    rows = []
    for t in threads:
        tt, tn = statistics.median(times[(t, "torch")]), statistics.median(times[(t, "native")])
        rows.append({"dtype": dtype_name, "context": ctx, "batch": batch, "threads": t,
                     "native_threads_used": native_threads(t, kv_bytes),
                     "layers_per_pass": len(layers), "torch_ms_per_layer": round(tt * 1e3, 4),
                     "native_ms_per_layer": round(tn * 1e3, 4), "speedup": round(tt / tn, 2),
                     "native_kv_gb_per_s": round(kv_bytes / tn / 1e9, 2),
                     "max_abs_diff_vs_torch": diff,
                     "torch_samples_ms": [round(x * 1e3, 4) for x in times[(t, "torch")]],
                     "native_samples_ms": [round(x * 1e3, 4) for x in times[(t, "native")]]})
        extra = ""
        if "baseline" in variants:
            tb = statistics.median(times[(t, "baseline")])
            rows[-1].update(baseline_ms_per_layer=round(tb * 1e3, 4), speedup_vs_baseline=round(tb / tn, 2),
                            baseline_kv_gb_per_s=round(kv_bytes / tb / 1e9, 2), max_abs_diff_vs_baseline=diff_b,
                            baseline_samples_ms=[round(x * 1e3, 4) for x in times[(t, "baseline")]])
            extra += f"  baseline {tb * 1e3:7.3f} ms ({kv_bytes / tb / 1e9:4.1f} GB/s) x{tb / tn:4.2f}"
        if "read" in variants:
            tr = statistics.median(times[(t, "read")])
            rows[-1].update(read_ms_per_layer=round(tr * 1e3, 4), read_gb_per_s=round(kv_bytes / tr / 1e9, 2),
                            native_time_over_read=round(tn / tr, 2),
                            read_samples_ms=[round(x * 1e3, 4) for x in times[(t, "read")]])
            extra += f"  read {kv_bytes / tr / 1e9:4.1f} GB/s (native/read x{tn / tr:4.2f})"
        print(f"{dtype_name:8s} ctx {ctx:5d} B {batch:4d} {t}t: torch {tt * 1e3:8.3f} ms  "
              f"native {tn * 1e3:7.3f} ms  x{tt / tn:5.2f}  ({kv_bytes / tn / 1e9:5.1f} GB/s, "
              f"diff {diff:.1e}){extra}", file=sys.stderr, flush=True)
    del layers
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--out", default="bench/results/kernels/attention_kernel.json")
    ap.add_argument("--note", default="")
    ap.add_argument("--baseline", default=None, help="git revision whose paged_decode.c to time beside this one")
    args = ap.parse_args(argv)
    if not native.available():
        sys.exit(f"native kernel unavailable: {native.unavailable_reason()}")
    threads = [int(t) for t in args.threads.split(",")]
    base, rd = build_extra(args.baseline)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    results = [row for d in args.dtypes.split(",") for ctx in map(int, args.contexts.split(","))
               for b in map(int, args.sizes.split(","))
               for row in run_case(b, ctx, d, threads, args.rounds, base, rd)]
    report = {
        "command": "python -m bench.attention_kernel " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_line(), "date_utc": started,
        "loadavg_before": load_before, "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        "torch": torch.__version__, "shapes": {"q_heads": HQ, "kv_heads": HKV, "head_dim": DIM,
                                                "block_size": BS},
        "method": "median over rounds of ms per layer call; each round runs torch then native "
                  "back to back per thread count; speedup = torch median / native median; "
                  "native_threads_used: the kernel runs 1 thread per 256 KiB of K/V, at most the "
                  "torch thread count",
        "baseline": args.baseline and subprocess.run(["git", "rev-parse", args.baseline], capture_output=True,
                                                      text=True).stdout.strip(),
        "native_isa": native.isa(), "note": args.note, "results": results}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
