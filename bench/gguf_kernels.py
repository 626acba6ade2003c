"""GGUF block kernels (worker_svc/backends/cpu/csrc/gguf_*.c) against the other linear paths,
and the engine's small-batch GGUF arithmetics against each other and against llama.cpp.

Part "layers": every linear layer of one SmolLM2-135M step (30 x qkv, o, gate_up, down in Q4_1, the
LM head in Q8_0, as the default GGUF stores them; random blocks: timing does not depend on values),
by token count T, each a full sweep over the weights (more than the L3, as in a real step):
* gguf-int8x2: integer dots on the file's blocks, activations in two 8-bit parts (the default; on
  AVX-512 VNNI builds the lane kernels: rows in a vector's lanes for 1-16 tokens, tokens above);
* gguf-int8: integer dots, activations in 8 bits (llama.cpp's method);
* gguf-block: the exact kernel (rows dequantized in cache, fp32 dots; the default before);
* float32-cached: F.linear on the dequantized fp32 weights kept in memory (the large path above
  GGUF_MAX_TOKENS on AVX2 builds; VNNI builds have no large path: gguf.py EVERY_T);
* dequant+float32: the blocks dequantized into a buffer on every call, then F.linear (the large
  path with large="dequant": no fp32 copy kept);
* int8-native: the older per-row int8 kernel (`--weight-quant int8-bf16`) on the same weights;
* gguf-int8x2-tiles / gguf-int8-tiles: the same integer dots on the 8-token tile kernels
  (SARATHI_GGUF_LANES=0; the AVX2 builds' serving default before the lane kernels took every
  call there too).
"gguf_beats_float_up_to_T": the largest T up to which a block kernel beats float32-cached at every
T (worker_svc/backends/cpu/gguf.py GGUF_MAX_TOKENS records the tile kernels' on Zen 3; up to the
largest T timed when it never loses).

Part "engine": SmolLM2's real GGUF on the ModelRunner, one process per arm (ARMS: --base-tree's code,
e.g. the code before a change; the default now, with the decode stack; the same with
SARATHI_NATIVE_STACK=0, layer by layer; the 8-token tile kernels; llama.cpp's 8-bit
activations) stepped in turn
(bench.common.EngineProcess), cases decode:1 and decode:32 at 1k context, prefill:512; llama.cpp's
llama-bench between the rounds (same GGUF, same threads: `-p 0 -n 32 -d 1024` = decode at depth
1024, `-p 512 -n 0` = prefill 512) and llama-batched-bench (32 sequences decoding at depth 1024,
the prompt shared); the bytes-read bound of decode:32 (the file's weight bytes
+ the bf16 KV read, over the copy bandwidth measured in the same run); each arm's resident memory
after its last step ("rss_MB": weights, KV cache, buffers).

--baseline REV adds "base-int8x2" / "base-int8": gguf_linear_q8 of git revision REV (its
kernel sources built beside this tree's with native.py's flags), timed in the same rounds, and the
largest difference of its outputs from this tree's ("max_abs_diff_vs_base", 0 = bit-identical);
--variants picks the layer variants to time (comma-separated; default all). --formats (with
--baseline) adds part "formats": gguf_linear_q8 against the baseline's on one [8192, 1536] weight of
each of the six formats, parts 2 and 1, by T.

    python -m bench.gguf_kernels [--rounds 5] [--threads 2] [--engine-rounds 10] [--no-llama]
                                 [--sizes 1,8,32] [--variants gguf-int8x2,gguf-int8] [--baseline HEAD~1] [--formats]
                                 [--base-tree DIR] [--out bench/results/kernels/gguf_kernels_zen4]
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import (
    BLOCK_SIZE,
    CONTEXT,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    EngineProcess,
    kernel_sources_at,
    layer_shapes,
    machine_line,
    rss_mb,
)
from bench.membw import copy_gb_per_s
from worker_svc.backends.cpu import native
from worker_svc.backends.cpu.quant import quantize_int8
from worker_svc.gguf_blocks import BLOCK_FORMATS, FORMAT_NAMES

SIZES = [1, 2, 4, 8, 12, 16, 32, 64]
Q4_1, Q8_0 = 3, 8
OLD, NEW = "before (base tree's default: per-row int8)", "new default (auto: the file's blocks)"
INT8 = "new --weight-quant int8 (Q8_0 groups)"


# byte offsets of each format's fp16 scales in a block (random bytes elsewhere)
HALVES = {2: [0], 3: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208]}


def random_blocks(qtype: int, n: int, k: int, g: np.random.Generator) -> torch.Tensor:
    elems, nbytes = BLOCK_FORMATS[qtype]
    raw = g.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    for off in HALVES[qtype]:
        h = (np.abs(g.standard_normal((n, k // elems))) * 0.01).astype(np.float16)
        raw[:, :, off:off + 2] = h.view(np.uint8).reshape(n, k // elems, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def bench_formats(rounds: int, sizes: list[int], baseline: str, n: int = 8192, k: int = 1536) -> dict:
    """gguf_linear_q8 (parts 2 and 1) against the baseline revision's, per format, on one random
    [n, k] weight of each of the six formats, by T (ms a call, medians of rounds alternating the
    variants' order; outputs compared too)."""
    g = np.random.default_rng(1)
    base = build_baseline(baseline)
    out: dict = {"shape": [n, k], "ms": {}, "speedup_vs_base": {}, "max_abs_diff_vs_base": {}}
    for qtype, name in FORMAT_NAMES.items():
        blocks = random_blocks(qtype, n, k, g)
        xs = {T: torch.randn(T, k) for T in sizes}
        fns = {"gguf-int8x2": lambda x: native.gguf_linear_q8(qtype, blocks, x, parts=2, check=False),
               "base-int8x2": lambda x: base_q8(base, qtype, blocks, x, 2),
               "gguf-int8": lambda x: native.gguf_linear_q8(qtype, blocks, x, parts=1, check=False),
               "base-int8": lambda x: base_q8(base, qtype, blocks, x, 1)}
        times: dict = {v: {T: [] for T in sizes} for v in fns}
        for T in sizes:                               # warm-up: first calls, buffers
            for fn in fns.values():
                fn(xs[T])
        for r in range(rounds):
            for T in sizes:
                reps = max(1, 16 // T)                # a sample: reps calls (>= ~10 ms at T=1)
                for v, fn in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):   # ABBA
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn(xs[T])
                    times[v][T].append((time.perf_counter() - t0) / reps)
        med = {v: {T: statistics.median(ts) for T, ts in d.items()} for v, d in times.items()}
        out["ms"][name] = {v: {str(T): round(1e3 * t, 3) for T, t in d.items()} for v, d in med.items()}
        out["speedup_vs_base"][name] = {
            new: {str(T): round(med[old][T] / med[new][T], 3) for T in sizes}
            for new, old in (("gguf-int8x2", "base-int8x2"), ("gguf-int8", "base-int8"))}
        out["max_abs_diff_vs_base"][name] = max(
            (fns[new](xs[T]) - fns[old](xs[T])).abs().max().item()
            for T in sizes for new, old in (("gguf-int8x2", "base-int8x2"), ("gguf-int8", "base-int8")))
        print(name, json.dumps(out["speedup_vs_base"][name]), flush=True)
    return out


def build_baseline(rev: str) -> ctypes.CDLL:
    """The native kernels of git revision rev (the GGUF kernels span several sources since the split
    of gguf_linear.c), built with native.py's compiler and flags into a temp dir."""
    tmp = Path(tempfile.mkdtemp(prefix="gguf_bench_"))
    sources = sorted(kernel_sources_at(rev, tmp / "csrc").glob("*.c"))
    subprocess.run([native._compiler(), *native._flags(), "-o", str(tmp / "base.so"), *map(str, sources), "-lm"],
                   check=True)
    lib = ctypes.CDLL(str(tmp / "base.so"))
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.gguf_linear_q8.argtypes = [I, P, L, P, L, P, P, L, I, I, I, I, I, I]
    lib.gguf_linear_q8.restype = I
    return lib


def base_q8(lib: ctypes.CDLL, qtype: int, blocks: torch.Tensor, x: torch.Tensor, parts: int) -> torch.Tensor:
    """The baseline library's gguf_linear_q8 (the call native.gguf_linear_q8 makes with its
    defaults: the lane kernels where built, as the gguf-int8x2 / gguf-int8 arms run)."""
    T, K = x.shape
    out = torch.empty(T, blocks.shape[0])
    rc = lib.gguf_linear_q8(qtype, blocks.data_ptr(), blocks.shape[1], x.data_ptr(), x.stride(0), None,
                            out.data_ptr(), out.stride(0), T, blocks.shape[0], K, torch.get_num_threads(), parts,
                            native._q8_flags(False, True))
    assert rc == 0, rc
    return out


def bench_layers(rounds: int, sizes: list[int], names: list[str] | None = None, baseline: str | None = None) -> dict:
    g = np.random.default_rng(0)
    layers = []
    shapes = layer_shapes()
    for i, (n, k) in enumerate(shapes):
        qtype = Q8_0 if i == len(shapes) - 1 else Q4_1
        blocks = random_blocks(qtype, n, k, g)
        w = native.gguf_dequantize(qtype, blocks, k)
        q, s = quantize_int8(w)
        layers.append((qtype, blocks, w, q, s))
    scratch = torch.empty(max(w.numel() for _, _, w, _, _ in layers))
    variants = {
        "gguf-int8x2": lambda L, x: native.gguf_linear_q8(L[0], L[1], x, parts=2, check=False),
        "gguf-int8": lambda L, x: native.gguf_linear_q8(L[0], L[1], x, parts=1, check=False),
        "gguf-block": lambda L, x: native.gguf_linear(L[0], L[1], x, check=False),
        "float32-cached": lambda L, x: F.linear(x, L[2]),
        "dequant+float32": lambda L, x: F.linear(x, native.gguf_dequantize(
            L[0], L[1], L[2].shape[1], out=scratch[:L[2].numel()].view(L[2].shape))),
        "int8-native": lambda L, x: native.int8_linear(x, L[3], L[4], None, check=False),
        "gguf-int8x2-tiles": lambda L, x: native.gguf_linear_q8(L[0], L[1], x, parts=2, lanes=False, check=False),
        "gguf-int8-tiles": lambda L, x: native.gguf_linear_q8(L[0], L[1], x, parts=1, lanes=False, check=False),
    }
    base = build_baseline(baseline) if baseline else None
    if base:
        variants["base-int8x2"] = lambda L, x: base_q8(base, L[0], L[1], x, 2)
        variants["base-int8"] = lambda L, x: base_q8(base, L[0], L[1], x, 1)
    if names:
        variants = {n: variants[n] for n in names}
    xs = {T: {k: torch.randn(T, k) for k in {k for _, k in shapes}} for T in sizes}
    times: dict = {v: {T: [] for T in sizes} for v in variants}
    for _ in range(rounds):
        for T in sizes:
            for name, fn in variants.items():
                t0 = time.perf_counter()
                for L in layers:
                    fn(L, xs[T][L[2].shape[1]])
                times[name][T].append(time.perf_counter() - t0)
    med = {v: {T: statistics.median(ts) for T, ts in d.items()} for v, d in times.items()}
    extra = {}
    # the lane kernels against the tile kernels: the same integer dots, another fp32 summation order
    extra["max_abs_diff_lanes_vs_tiles"] = {
        f"int8x{parts}" if parts == 2 else "int8": max(
            (native.gguf_linear_q8(L[0], L[1], xs[T][L[2].shape[1]], parts=parts, check=False)
             - native.gguf_linear_q8(L[0], L[1], xs[T][L[2].shape[1]], parts=parts, lanes=False, check=False))
            .abs().max().item() for T in sizes for L in layers) for parts in (2, 1)}
    if base:       # this tree's outputs against the baseline's, every layer and T
        for lanes in (True, False):
            extra["max_abs_diff_vs_base" + ("" if lanes else "_tiles")] = {
                f"int8x{parts}" if parts == 2 else "int8": max(
                    (native.gguf_linear_q8(L[0], L[1], xs[T][L[2].shape[1]], parts=parts, lanes=lanes, check=False)
                     - base_q8(base, L[0], L[1], xs[T][L[2].shape[1]], parts)).abs().max().item()
                    for T in sizes for L in layers) for parts in (2, 1)}
        extra["speedup_vs_base"] = {
            new: {str(T): round(med[old][T] / med[new][T], 3) for T in sizes}
            for new, old in (("gguf-int8x2", "base-int8x2"), ("gguf-int8", "base-int8"),
                             ("gguf-int8x2-tiles", "base-int8x2"), ("gguf-int8-tiles", "base-int8"))
            if new in med and old in med}
    threshold = {}
    for kernel in ("gguf-int8x2", "gguf-block", "gguf-int8x2-tiles"):
        if kernel not in med or "float32-cached" not in med:
            continue
        threshold[kernel] = 0
        for T in sizes:
            if med[kernel][T] < med["float32-cached"][T]:
                threshold[kernel] = T
            else:
                break
    return {"ms": {v: {str(T): round(1e3 * s, 3) for T, s in d.items()} for v, d in med.items()},
            "block_bytes": sum(b.numel() for _, b, _, _, _ in layers),
            "fp32_bytes": sum(4 * w.numel() for _, _, w, _, _ in layers),
            "gguf_beats_float_up_to_T": threshold, **extra}


def read_bandwidth(threads: int) -> float:
    """Bytes/s of a plain read (bench.attention_kernel's read_blocks: load, widen, add) of decode:32's
    bf16 K/V layout (32 sequences x 65 blocks, 30 layers, randomly placed blocks), by `threads`
    Python threads over the layers (ctypes drops the GIL): the rate at which the step's bytes can be
    read at all on this machine, median of 3."""
    import threading

    from bench.attention_kernel import build_extra

    _, rd = build_extra(None)
    nblk = 32 * (CONTEXT // BLOCK_SIZE + 1)
    shape = (nblk, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    kv = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)) for _ in range(LAYERS)]
    table = torch.randperm(nblk, generator=torch.Generator().manual_seed(0)).int()
    per_block = BLOCK_SIZE * KV_HEADS * HEAD_DIM

    def part(ls):
        for k, v in ls:
            rd.read_blocks(k.data_ptr(), v.data_ptr(), table.data_ptr(), nblk, per_block)
    rates = []
    for _ in range(3):
        ths = [threading.Thread(target=part, args=(kv[i::threads],)) for i in range(threads)]
        t0 = time.perf_counter()
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        rates.append(LAYERS * 2 * kv[0][0].numel() * 2 / (time.perf_counter() - t0))
    return statistics.median(rates)


def llama_build_dir() -> str:
    """The llama.cpp build bench/build_llama_server.sh made: SARATHI_LLAMA_ISA=avx2 picks its AVX2
    build (LLAMA_ISA=avx2 there), anything else the -march=native one."""
    import os

    return "build-11434.0.0" + ("-avx2" if os.environ.get("SARATHI_LLAMA_ISA") == "avx2" else "")


def llama_bench_once(threads: int) -> dict:
    """One llama-bench run on the default GGUF: decode 32 tokens at depth 1024 (seconds a step)
    and prefill 512 from an empty context, and (when built) one llama-batched-bench run of 32
    sequences decoding at depth 1024; the binaries from bench/build_llama_server.sh."""
    import os

    from shared.model_source import default_gguf_path

    build = llama_build_dir()
    binary = Path(os.environ.get("SARATHI_PEER_CACHE", Path.home() / ".cache/sarathi-peer")) / build / "bin/llama-bench"
    if not binary.exists():
        raise SystemExit(f"llama-bench not built ({binary}): bench/build_llama_server.sh builds it"
                         + (" (with LLAMA_ISA=avx2)" if build.endswith("-avx2") else ""))
    out = {}
    for case, args in (("decode:1", ["-p", "0", "-n", "32", "-d", "1024"]), ("prefill:512", ["-p", "512", "-n", "0"])):
        cmd = [str(binary), "-m", str(default_gguf_path()), *args, "-t", str(threads), "-r", "1", "-o", "json"]
        r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout)[0]
        out[case] = (512 if case == "prefill:512" else 1) / r["avg_ts"]
        LLAMA_CMDS[case] = " ".join([f"~/.cache/sarathi-peer/{build}/bin/llama-bench", "-m",
                                     default_gguf_path().name, *cmd[3:]])
    # 32 sequences decoding at depth 1024: llama-batched-bench with the prompt shared (-pps: one
    # 1024-token prefill instead of 32, ~5 s vs ~150 s). llama.cpp then keeps one copy of the
    # prompt's K/V and reads the cache once for all 32 queries (a masked attention over its
    # cells), fewer bytes than our 32 separate contexts: in llama.cpp's favour
    batched = binary.with_name("llama-batched-bench")
    if batched.exists():
        cmd = [str(batched), "-m", str(default_gguf_path()), "-c", "36000", "-b", "2048", "-ub", "512",
               "-npp", "1024", "-ntg", "16", "-npl", "32", "-pps", "-t", str(threads), "--output-format", "jsonl"]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
        r = json.loads([line for line in res.splitlines() if line.startswith("{")][-1])
        out["decode:32"] = r["t_tg"] / r["tg"]          # seconds a step of 32 tokens
        LLAMA_CMDS["decode:32"] = " ".join([f"~/.cache/sarathi-peer/{build}/bin/llama-batched-bench",
                                            "-m", default_gguf_path().name, *cmd[3:]])
    return out


LLAMA_CMDS: dict = {}
STEPS = {"decode:1": 8, "decode:32": 3, "prefill:512": 1}     # timed consecutive steps per round
LLAMA = "llama.cpp, same GGUF (llama-bench; decode 32: llama-batched-bench, prompt shared)"
NEW = "new default (int8x2 dot, lane kernels, decode stack)"
TILES = "8-token tile kernels (SARATHI_GGUF_LANES=0), int8x2, decode stack"
LANES = "lane kernels where built (SARATHI_GGUF_LANES=1), int8x2, decode stack"
# the engine's arms: (tree: None = this one, else --base-tree; environment)
ARMS = {"base tree (--base-tree)": ("base", {}),
        NEW: (None, {}),
        "layer by layer (SARATHI_NATIVE_STACK=0)": (None, {"SARATHI_NATIVE_STACK": "0"}),
        TILES: (None, {"SARATHI_GGUF_LANES": "0"}),
        LANES: (None, {"SARATHI_GGUF_LANES": "1"}),
        "int8 dot (llama.cpp's activation quantization), decode stack": (None, {"SARATHI_GGUF_DOT": "int8"})}


ENGINE_CASES = ["decode:1", "decode:32", "prefill:512"]


def step_in_turn(procs: dict, cases: list[str], rounds: int, threads: int, llama: bool,
                 on_round=None) -> dict:
    """{arm (and LLAMA): {case: [seconds a step, one median per round]}}: the engine processes
    stepped in turn (one warm-up step per case, then ABBA rounds), llama-bench between rounds
    when `llama`; on_round(r, times) after each round (progress)."""
    times: dict = {name: {c: [] for c in cases} for name in [*procs, *([LLAMA] if llama else [])]}
    for c in cases:                                   # warm-up
        for p in procs.values():
            p.step(c)
    for r in range(rounds):
        order = list(procs.items()) if r % 2 == 0 else list(procs.items())[::-1]   # ABBA
        for c in cases:
            for name, p in order:
                # STEPS[c] consecutive steps, as llama-bench times consecutive tokens: the first
                # after another process ran pays for the caches that process left (dropped)
                ts = [p.step(c)["s"] for _ in range(STEPS[c] + 1)][1:]
                times[name][c].append(statistics.median(ts))
        if llama:
            for c, sec in llama_bench_once(threads).items():
                times[LLAMA][c].append(sec)
        if on_round is not None:
            on_round(r, times)
    return times


def bench_engine(rounds: int, threads: int, block_bytes: int, llama: bool, base: Path | None = None) -> dict:
    """The engine on SmolLM2's GGUF (defaults; each arm of ARMS a process), stepped in turn, and
    llama-bench between the engine's rounds (same hold, same GGUF, same threads). base: another
    source tree (e.g. `git archive REV | tar -x -C DIR`) run as the first arm; None: no such arm."""
    tree = Path(__file__).resolve().parent.parent
    procs = {name: EngineProcess(tree if t is None else base, threads, "float32:auto:auto", env=env)
             for name, (t, env) in ARMS.items() if t is None or base is not None}
    times = step_in_turn(procs, ENGINE_CASES, rounds, threads, llama)
    info = {name: p.info["ready"] for name, p in procs.items()}
    # after every case: weights, KV cache, buffers
    rss = {name: round(rss_mb(p.proc.pid), 1) for name, p in procs.items()}
    for p in procs.values():
        p.close()
    med = {name: {c: round(1e3 * statistics.median(ts), 2) for c, ts in d.items() if ts} for name, d in times.items()}
    kv_bytes = 32 * (CONTEXT + 1) * 2 * LAYERS * KV_HEADS * HEAD_DIM * 2    # bf16 K and V
    bw, rbw = 1e9 * copy_gb_per_s(256, 5, threads), read_bandwidth(threads)
    bound_ms, read_bound_ms = 1e3 * (block_bytes + kv_bytes) / bw, 1e3 * (block_bytes + kv_bytes) / rbw
    new = NEW
    res = {"ms": med, "backends": info, "rss_MB": rss, "block_size": BLOCK_SIZE, "llama_bench_commands": LLAMA_CMDS,
           "decode32_bound": {"weight_bytes": block_bytes, "kv_bytes": kv_bytes, "copy_bw_GBps": round(bw / 1e9, 2),
                              "bound_ms": round(bound_ms, 2),
                              "ratio_new_default": round(med[new]["decode:32"] / bound_ms, 2),
                              # the same bytes at the rate a plain read of the K/V blocks reaches here
                              "read_bw_GBps": round(rbw / 1e9, 2), "read_bound_ms": round(read_bound_ms, 2),
                              "ratio_new_default_read": round(med[new]["decode:32"] / read_bound_ms, 2),
                              "ratio_tiles_read": round(med[TILES]["decode:32"] / read_bound_ms, 2),
                              "ratio_lanes_read": round(med[LANES]["decode:32"] / read_bound_ms, 2)}}
    if llama:
        res["new_default_over_llama"] = {c: round(med[new][c] / med[LLAMA][c], 3) for c in med[LLAMA]}
    return res


def cpu_id() -> str:
    """lscpu's model name, family and model (machine_line has only the name)."""
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        k, _, v = line.partition(":")
        if k.strip() in ("model name", "cpu family", "model") and k.strip() not in fields:
            fields[k.strip()] = v.strip()
    return f"{fields.get('model name')}, family {fields.get('cpu family')} model {fields.get('model')}"


def pressure() -> str | None:
    """/proc/pressure/cpu's "some" line: time runnable tasks waited for a CPU (other processes'
    load on this shared machine shows here), None where the kernel has no PSI."""
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engine-rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--variants", default=None, help="layer variants to time (comma-separated; default all)")
    ap.add_argument("--baseline", default=None, help="git revision whose gguf_linear_q8 to time beside this one")
    ap.add_argument("--formats", action="store_true",
                    help="with --baseline: also gguf_linear_q8 per format (all six) against the baseline's")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--no-layers", action="store_true", help="the engine part only")
    ap.add_argument("--no-llama", action="store_true", help="no llama-bench rounds")
    ap.add_argument("--base-tree", type=Path, help="a source tree to run as the engine's 'before' arm "
                    "(git archive REV | tar -x -C DIR)")
    ap.add_argument("--out", default="bench/results/kernels/gguf_kernels_amd")
    args = ap.parse_args(argv)
    if not native.available():
        sys.exit(f"native kernels unavailable: {native.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    now = datetime.datetime.now(datetime.timezone.utc)
    command = "python -m bench.gguf_kernels " + " ".join(argv if argv is not None else sys.argv[1:])
    res = {"machine": machine_line(), "cpu": cpu_id(), "date": now.isoformat(timespec="seconds"), "command": command,
           "threads": args.threads, "gguf_isa": native.gguf_isa(),
           "loadavg_start": Path("/proc/loadavg").read_text().split()[:3], "cpu_pressure_start": pressure(),
           "layers": {"block_bytes": sum(BLOCK_FORMATS[Q8_0 if i == len(layer_shapes()) - 1 else Q4_1][1] * n * k
                                         // BLOCK_FORMATS[Q4_1][0] for i, (n, k) in enumerate(layer_shapes()))}
           if args.no_layers else bench_layers(args.rounds, [int(t) for t in args.sizes.split(",")],
                                               args.variants.split(",") if args.variants else None, args.baseline)}
    print(json.dumps(res["layers"], indent=1), flush=True)
    if args.formats:
        if not args.baseline:
            sys.exit("--formats needs --baseline")
        res["formats"] = bench_formats(args.rounds, [int(t) for t in args.sizes.split(",")], args.baseline)
    if not args.no_engine:
        res["engine"] = bench_engine(args.engine_rounds, args.threads, res["layers"]["block_bytes"],
                                     not args.no_llama, args.base_tree)
        print(json.dumps(res["engine"], indent=1), flush=True)
    res["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    res["cpu_pressure_end"] = pressure()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    if not args.no_layers:
        plot(res, out.with_suffix(".png"))


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eng = res.get("engine")
    fig, axes = plt.subplots(1, 2 if eng else 1, figsize=(13 if eng else 7, 4.8), squeeze=False)
    ax = axes[0][0]
    for name, d in res["layers"]["ms"].items():
        ts = [int(t) for t in d]
        ax.plot(ts, list(d.values()), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per step (T)")
    ax.set_ylabel("ms per SmolLM2 step, all linear layers")
    ax.set_title("linear layers alone", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    if eng:
        ax = axes[0][1]
        cases = ["decode:1", "decode:32", "prefill:512"]
        names = list(eng["ms"])
        w = 0.8 / len(names)
        for i, name in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * w for j, c in enumerate(cases) if c in eng["ms"][name]]
            ys = [eng["ms"][name][c] for c in cases if c in eng["ms"][name]]
            ax.bar(xs, ys, w, label=name)
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:.0f}" if y >= 100 else f"{y:.1f}", ha="center", va="bottom", fontsize=6)
        ax.axhline(eng["decode32_bound"]["bound_ms"], color="k", ls=":", lw=1,
                   label=f"decode:32 bytes-read bound at copy bandwidth {eng['decode32_bound']['bound_ms']} ms")
        if "read_bound_ms" in eng["decode32_bound"]:
            ax.axhline(eng["decode32_bound"]["read_bound_ms"], color="r", ls=":", lw=1,
                       label=f"... at a plain read's rate of the blocks {eng['decode32_bound']['read_bound_ms']} ms")
        ax.set_xticks(range(len(cases)), ["decode 1 @1k", "decode 32 @1k", "prefill 512"])
        ax.set_yscale("log")
        ax.set_ylabel("ms per step (median)")
        ax.set_title("engine (SmolLM2 Q4_1 GGUF) vs llama.cpp, same run", fontsize=9)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3, axis="y", which="both")
    fig.suptitle(f"GGUF kernels, {res['threads']} threads, {res['machine'][:60]}, {res['date'][:16]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
