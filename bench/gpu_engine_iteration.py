"""Engine iteration time on a GPU with random-init Llama-3-8B shapes (bf16), next to its bounds
and the speed goals.

The model is created in memory, tensor by tensor on the device (random_weights): no checkpoint,
no download. Shapes: 32 layers, hidden 4096, 32 q / 8 kv heads, head_dim 128, intermediate
14336, vocab cut to 49152 (as the first H100 measurements). Every case runs through ModelRunner.execute
(prepare + forward + sampling, token ids back on the host), median over rounds, in two variants
of the same executor: CUDA graphs on (decode-only batches replay a graph) and off (eager).

Bounds: a step reads the weights (and the batch's KV) once at the copy bandwidth; a prefill
does 2 x params x tokens FLOPs (+ attention) at the bf16 GEMM rate (defaults: an H100's measured
3.0 TB/s and 650 TFLOP/s; bench.gpu_check passes the rates it measures on the machine).

    python -m bench.gpu_engine_iteration [--rounds 5] [--out bench/results/gpu/gpu_engine_iteration]
writes <out>.json, <out>.png, <out>_profile.txt (torch.profiler, CUDA time by kernel).
`--tiny --device cpu` runs the same code on a tiny model (what the CPU test checks).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

from shared.config import CacheConfig, WorkerConfig
from shared.messages import Batch, SeqChunk
from shared.sampling import SamplingParams
from worker_svc.loader import LazyWeights, expected_shapes
from worker_svc.model_config import ModelConfig
from worker_svc.model_runner import ModelRunner

BLOCK_SIZE = 16
HBM_BYTES_PER_S = 3.0e12          # device-to-device copy measured on an H100
DENSE_FLOPS = 650e12              # bf16 dense matmul rate large prefills reached on an H100
GREEDY = SamplingParams(temperature=0.0)
# the speed goals on an H100 (seconds); hybrid: 32 decodes + 512 chunk <= 1.2x the chunk alone
GOALS = {"decode:1": 0.006, "decode:32": 0.009, "decode:128": 0.015, "prefill:2048": 0.050}
HYBRID_GOAL_RATIO = 1.2


def llama3_8b_config(**overrides) -> ModelConfig:
    """Llama-3-8B's shapes (vocab cut to 49152); overrides shrink it for tests."""
    base = dict(model_type="llama", vocab_size=49152, hidden_size=4096, intermediate_size=14336,
                num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=4096, eos_token_ids=[1])
    return ModelConfig(**{**base, **overrides})


def tiny_config() -> ModelConfig:
    return llama3_8b_config(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048)


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: str, seed: int = 0) -> LazyWeights:
    """Every tensor the model needs, created on `device` in `dtype` when the model asks for it:
    normal(0, 0.02) matrices, norm weights 1 (so activations stay in range through 32 layers)."""
    gen_device = torch.device(device)
    shapes = expected_shapes(cfg)

    def make(name: str) -> torch.Tensor:
        shape = shapes[name]
        if len(shape) == 1:
            return torch.ones(shape, dtype=dtype, device=gen_device)
        g = torch.Generator(device=gen_device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return (torch.randn(shape, generator=g, device=gen_device, dtype=torch.float32) * 0.02).to(dtype)

    return LazyWeights(shapes, make, Path("random-init"))


def cases(tiny: bool) -> list[tuple[str, int, int]]:
    """(series, size, context): decode batches at 1k context, prefill chunks alone, and
    32 decodes + a chunk (the hybrid batch Sarathi-Serve builds). The chunk of TAU - 32 tokens is
    the one Sarathi's budget gives beside 32 decodes (the decodes count against it): its batch
    has as many rows as the TAU chunk alone, so the GEMMs run the same tiles."""
    ctx = 64 if tiny else 1024
    aligned = budget_tokens(tiny) - hybrid_decodes(tiny)
    decode = [1, 2, 4] if tiny else [1, 2, 4, 8, 16, 32, 64, 128]
    prefill = [16, aligned, 64] if tiny else [128, aligned, 512, 1024, 2048]
    hybrid = [16, aligned, 64] if tiny else [128, aligned, 512]
    return ([("decode", b, ctx) for b in decode] + [("prefill", n, 0) for n in prefill]
            + [("hybrid", n, ctx) for n in hybrid])


def hybrid_decodes(tiny: bool) -> int:
    return 2 if tiny else 32


def budget_tokens(tiny: bool) -> int:
    """The token budget (tau) of the hybrid goal: the chunk alone is this long."""
    return 64 if tiny else 512


def make_batch(series: str, size: int, ctx: int, tiny: bool) -> Batch:
    per_seq = ctx // BLOCK_SIZE + 1
    n_dec = size if series == "decode" else hybrid_decodes(tiny) if series == "hybrid" else 0
    seqs = [SeqChunk(f"d{i}", [100 + i], ctx, list(range(i * per_seq, (i + 1) * per_seq)), True, GREEDY, 1)
            for i in range(n_dec)]
    if series != "decode":
        first = n_dec * per_seq
        seqs.append(SeqChunk("p", [200] * size, 0, list(range(first, first + -(-size // BLOCK_SIZE))),
                             True, GREEDY))
    return Batch(0, seqs)


def blocks_needed(tiny: bool) -> int:
    """KV blocks for the largest case (block ids are reused across cases: the values are noise)."""
    return max(sum(len(s.block_table) for s in make_batch(*c, tiny).seqs) for c in cases(tiny))


def bound_s(cfg: ModelConfig, series: str, size: int, ctx: int, tiny: bool, kv_bytes_per_token: int,
            hbm_bytes_per_s: float = HBM_BYTES_PER_S, dense_flops: float = DENSE_FLOPS) -> float:
    """The lower bound of one iteration: max(bytes / HBM bandwidth, FLOPs / dense rate); the
    rates default to an H100's, bench.gpu_check passes the ones it measured."""
    h, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    layer_params = h * (q + 2 * kv) + q * h + 3 * h * f
    params = cfg.num_layers * layer_params + cfg.vocab_size * h        # + LM head (embedding: rows only)
    n_dec = size if series == "decode" else hybrid_decodes(tiny) if series == "hybrid" else 0
    n_chunk = 0 if series == "decode" else size
    tokens = n_dec + n_chunk
    kv_read = n_dec * (ctx + 1) * kv_bytes_per_token + n_chunk * kv_bytes_per_token
    memory = (params * 2 + kv_read) / hbm_bytes_per_s
    attn_flops = 4 * cfg.num_layers * q * (n_chunk * n_chunk / 2 + n_dec * ctx)
    compute = (2 * params * tokens + attn_flops) / dense_flops
    return max(memory, compute)


def measure(ex: ModelRunner, tiny: bool, rounds: int) -> dict:
    """variant -> "series:size" -> seconds per round; variants interleaved per case."""
    graphs = ex.graphs
    variants = {"graphs": graphs, "eager": None} if graphs is not None else {"eager": None}
    batches = {c: make_batch(*c, tiny) for c in cases(tiny)}
    times = {v: {f"{s}:{n}": [] for s, n, _ in batches} for v in variants}
    sync = torch.cuda.synchronize if ex.backend.device.type == "cuda" else (lambda: None)
    for v, g in variants.items():                 # warm-up: first use of every shape
        ex.graphs = g
        for b in batches.values():
            ex.execute(b)
    for r in range(rounds):
        for (s, n, _), b in batches.items():
            for v, g in variants.items():
                ex.graphs = g
                sync()
                t0 = time.perf_counter()
                ex.execute(b)                     # ends with token ids on the host: synchronous
                times[v][f"{s}:{n}"].append(time.perf_counter() - t0)
        print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    ex.graphs = graphs
    return times


AHEAD_STEPS = 8   # decode steps per chain launched ahead (positions ctx .. ctx + 8 fit the blocks)


def ahead_step_s(ex: ModelRunner, b: Batch, steps: int = AHEAD_STEPS) -> float:
    """Seconds per decode step when each step is launched before the one before it is read
    back, its tokens taken on the device (async scheduling's worker path): the same decodes
    at positions ctx, ctx + 1, ..., the GPU's next step queued while the host prepares it."""
    import dataclasses

    from shared.messages import PENDING_TOKEN

    def step(k: int) -> Batch:
        return Batch(k, [dataclasses.replace(s, token_ids=[PENDING_TOKEN], start_pos=s.start_pos + k,
                                             output_index=s.output_index + k) for s in b.seqs])
    t0 = time.perf_counter()
    run = ex.launch(b)
    for k in range(1, steps + 1):
        nxt = ex.launch(step(k))
        ex.finish(run)
        run = nxt
    ex.finish(run)
    return (time.perf_counter() - t0) / (steps + 1)


def decode_split(ex: ModelRunner, tiny: bool, rounds: int) -> dict:
    """Where a graph-replayed decode step's time goes: "decode:B" -> step_s (execute, as
    measured), graph_s (the captured graph replayed back to back: the GPU's part) and host_s
    (execute with the replay left out: metadata, FlashInfer's plan, input copies, sampling
    launches, the token ids' copy back; the GPU idles meanwhile). step - graph is what the host
    adds to a step; ahead_s: a step launched before the previous one is read back
    (ahead_step_s), what overlapping the host's work with the GPU's leaves. {} without graphs.
    Medians over rounds."""
    g = ex.graphs
    if g is None:
        return {}
    sync = torch.cuda.synchronize if ex.backend.device.type == "cuda" else (lambda: None)
    out = {}
    for s, n, ctx in cases(tiny):
        if s != "decode" or n > g.sizes[-1]:
            continue
        b, size = make_batch(s, n, ctx, tiny), next(z for z in g.sizes if z >= n)
        replay = g.replays[size]
        step, graph, host, ahead = [], [], [], []
        ex.execute(b)
        ahead_step_s(ex, b)
        for _ in range(rounds):
            sync()
            t0 = time.perf_counter()
            ex.execute(b)
            step.append(time.perf_counter() - t0)
            sync()
            t0 = time.perf_counter()
            for _ in range(10):
                replay()
            sync()
            graph.append((time.perf_counter() - t0) / 10)
            g.replays[size] = lambda: None
            try:
                sync()
                t0 = time.perf_counter()
                ex.execute(b)
                host.append(time.perf_counter() - t0)
            finally:
                g.replays[size] = replay
            sync()
            ahead.append(ahead_step_s(ex, b))
        out[f"decode:{n}"] = {"step_s": statistics.median(step), "graph_s": statistics.median(graph),
                              "host_s": statistics.median(host), "ahead_s": statistics.median(ahead)}
    return out


def host_profile(ex: ModelRunner, tiny: bool, path: Path, calls: int = 50) -> None:
    """cProfile of the host's work alone in a graph-replayed decode step (32 decodes; 4 tiny):
    execute with the replay left out, as decode_split's host_s, `calls` times; the 30 functions
    with the most cumulative time (FlashInfer's plan, metadata, sampling, copies). Nothing
    without graphs."""
    import cProfile
    import io
    import pstats

    g = ex.graphs
    if g is None:
        return
    n = 4 if tiny else 32
    b, size = make_batch("decode", n, 64 if tiny else 1024, tiny), next(z for z in g.sizes if z >= n)
    replay, g.replays[size] = g.replays[size], (lambda: None)
    try:
        ex.execute(b)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            ex.execute(b)
        prof.disable()
    finally:
        g.replays[size] = replay
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
    root = str(Path(__file__).resolve().parent.parent) + "/"
    lines = [re.sub(r"\S*/(site-packages|python3\.\d+)/", r"\1/", ln.replace(root, ""))   # no machine paths
             for ln in text.getvalue().splitlines() if ln.strip()]
    path.write_text(f"# host work alone of a decode step of {n} ({calls} calls, replay left out; "
                    f"{gpu_info()})\n" + "\n".join(lines) + "\n")


def summarize(times: dict, cfg: ModelConfig, tiny: bool, kv_bytes_per_token: int,
              hbm_bytes_per_s: float = HBM_BYTES_PER_S, dense_flops: float = DENSE_FLOPS) -> dict:
    out = {}
    for v, by_case in times.items():
        out[v] = []
        for s, n, ctx in cases(tiny):
            ts = by_case[f"{s}:{n}"]
            out[v].append({"series": s, "size": n, "context": ctx, "median_s": statistics.median(ts),
                           "min_s": min(ts), "bound_s": bound_s(cfg, s, n, ctx, tiny, kv_bytes_per_token,
                                                                hbm_bytes_per_s, dense_flops),
                           "samples_s": [round(t, 6) for t in ts]})
    return out


def against_goals(summary: dict, tiny: bool, hbm_bytes_per_s: float = HBM_BYTES_PER_S,
                  split: dict | None = None) -> dict:
    """Each goal with the best variant's median next to it and the bound. The goals are set for
    an H100 (3.0 TB/s copy): the memory-bound ones (decodes) scale by hbm_bytes_per_s, so a GPU
    with faster memory (an H200) is held to the same fraction of its bound. split: decode_split's
    result; its steps launched ahead (async scheduling) count as the variant "graphs, ahead"."""
    best = {}
    for v, pts in summary.items():
        for p in pts:
            key = f"{p['series']}:{p['size']}"
            if key not in best or p["median_s"] < best[key]["median_s"]:
                best[key] = dict(p, variant=v)
    for key, v in (split or {}).items():
        if key in best and v.get("ahead_s") is not None and v["ahead_s"] < best[key]["median_s"]:
            best[key] = dict(best[key], median_s=v["ahead_s"], variant="graphs, ahead")
    goals = {}
    for key, goal in GOALS.items():
        if key.startswith("decode"):
            goal *= HBM_BYTES_PER_S / hbm_bytes_per_s
        if key in best:
            goals[key] = {"goal_s": goal, "measured_s": best[key]["median_s"], "bound_s": best[key]["bound_s"],
                          "variant": best[key]["variant"], "met": best[key]["median_s"] <= goal}
    chunk = budget_tokens(tiny)
    aligned = chunk - hybrid_decodes(tiny)
    # the goal as set (the chunk and the decodes on top of it), then the same ratio where the
    # decodes count against the budget (Sarathi's batch: as many rows as the chunk alone), against
    # the chunk alone of the same length and against the budget's full chunk
    for hyb, alone in ((chunk, chunk), (aligned, aligned), (aligned, chunk)):
        if f"hybrid:{hyb}" in best and f"prefill:{alone}" in best:
            ratio = best[f"hybrid:{hyb}"]["median_s"] / best[f"prefill:{alone}"]["median_s"]
            goals[f"hybrid:{hyb}/prefill:{alone}"] = {"goal_ratio": HYBRID_GOAL_RATIO, "measured_ratio": ratio,
                                                       "met": ratio <= HYBRID_GOAL_RATIO}
    return goals


def plot(summary: dict, path: Path, split: dict | None = None) -> None:
    """Iteration time against size per series, with the bound; with a decode split, a fourth
    panel: each replayed decode step as its graph's GPU time and what the host adds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4 if split else 3, figsize=(21 if split else 16, 4.5))
    for ax, series in zip(axes, ("decode", "prefill", "hybrid")):
        for v, pts in summary.items():
            sel = [p for p in pts if p["series"] == series]
            ax.plot([p["size"] for p in sel], [p["median_s"] * 1e3 for p in sel], "o-", label=v)
        sel = [p for p in next(iter(summary.values())) if p["series"] == series]
        ax.plot([p["size"] for p in sel], [p["bound_s"] * 1e3 for p in sel], "k--", label="bound (measured rates)")
        ax.set(xscale="log", yscale="log", xlabel="decodes" if series == "decode" else "chunk tokens",
               ylabel="iteration (ms, median)", title={"decode": "decode-only batch",
                                                       "prefill": "prefill chunk alone",
                                                       "hybrid": "decodes + prefill chunk"}[series])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    if split:
        ax, keys = axes[3], list(split)
        gpu = [split[k]["graph_s"] * 1e3 for k in keys]
        host = [max(0.0, split[k]["step_s"] - split[k]["graph_s"]) * 1e3 for k in keys]
        ax.bar(range(len(keys)), gpu, label="graph replay (GPU)")
        ax.bar(range(len(keys)), host, bottom=gpu, label="added by the host")
        if all("ahead_s" in split[k] for k in keys):
            ax.plot(range(len(keys)), [split[k]["ahead_s"] * 1e3 for k in keys], "k_", markersize=22,
                    markeredgewidth=2.5, label="step launched ahead (async scheduling)")
        ax.set_xticks(range(len(keys)), [k.split(":")[1] for k in keys])
        ax.set(xlabel="decodes (CUDA graph)", ylabel="step (ms, median)", title="decode step: GPU vs host")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def profile(ex: ModelRunner, tiny: bool, path: Path) -> None:
    """Kernel table (CUDA time) of the decode-1, decode-32, prefill-512, hybrid 32+512 and 32+480 steps:
    what remains (the hybrid step against its chunk alone)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ex.backend.device.type == "cuda" else [])
    sort = "cuda_time_total" if ex.backend.device.type == "cuda" else "self_cpu_time_total"
    parts = [f"# python -m bench.gpu_engine_iteration --profile  ({gpu_info()}, "
             f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')})\n"]
    tau = budget_tokens(tiny)
    picks = [("decode", 1), ("decode", 4 if tiny else 32), ("prefill", tau), ("hybrid", tau),
             ("hybrid", tau - hybrid_decodes(tiny))]
    for series, size in picks:
        c = next(c for c in cases(tiny) if c[:2] == (series, size))
        b = make_batch(*c, tiny)
        ex.execute(b)
        with torch_profile(activities=acts) as prof:
            for _ in range(3):
                ex.execute(b)
        parts.append(f"## {series} {size} (3 iterations, CUDA graphs {'on' if ex.graphs else 'off'})\n"
                     + prof.key_averages().table(sort_by=sort, row_limit=20) + "\n")
    path.write_text("\n".join(parts))


def gpu_info() -> str:
    if not torch.cuda.is_available():
        return f"no GPU ({platform.processor() or platform.machine()})"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except Exception:
        driver = "unknown"
    return (f"{torch.cuda.get_device_name()}, driver {driver}, CUDA {torch.version.cuda}, "
            f"torch {torch.__version__}")


def build_model_runner(tiny: bool, device: str, cuda_graphs: bool,
                       attention: str = "auto") -> tuple[ModelRunner, ModelConfig]:
    cfg = tiny_config() if tiny else llama3_8b_config()
    dtype = "float32" if device == "cpu" else "bfloat16"
    wc = WorkerConfig(dtype=dtype, device=device, cache=CacheConfig(BLOCK_SIZE, blocks_needed(tiny)),
                      attention=attention, cuda_graphs=cuda_graphs, max_num_seqs=max(
                          n for s, n, _ in cases(tiny) if s == "decode"))
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    dev = device if device == "cpu" or ":" in device else "cuda:0"
    return ModelRunner(wc, weights=(cfg, random_weights(cfg, torch_dtype, dev))), cfg


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention", default="auto", help="auto, flashinfer or torch (the old path)")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--tiny", action="store_true", help="a tiny model (smoke test; CPU works)")
    ap.add_argument("--out", default="bench/results/gpu/gpu_engine_iteration")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--ops", choices=("torch", "flashinfer"), default=None,
                    help="the layers' elementwise ops on CUDA (SARATHI_CUDA_OPS; default: the backend's)")
    ap.add_argument("--hbm-tbs", type=float, default=HBM_BYTES_PER_S / 1e12,
                    help="copy bandwidth for the bounds, TB/s (default: the H100's; gpu_check measures it)")
    ap.add_argument("--dense-tflops", type=float, default=DENSE_FLOPS / 1e12,
                    help="bf16 GEMM rate for the bounds, TFLOP/s (default: the H100's; gpu_check measures it)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    if args.ops:
        os.environ["SARATHI_CUDA_OPS"] = args.ops
    ex, cfg = build_model_runner(args.tiny, args.device, args.cuda_graphs, args.attention)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * ex.cache.k[0].element_size()
    hbm, flops = args.hbm_tbs * 1e12, args.dense_tflops * 1e12
    summary = summarize(measure(ex, args.tiny, args.rounds), cfg, args.tiny, kv_per_token, hbm, flops)
    result = {
        "command": "python -m bench.gpu_engine_iteration " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu_info(), "backend": ex.backend.describe(),
        "model": "random-init " + ("tiny Llama" if args.tiny else "Llama-3-8B shapes (vocab 49152)"),
        "dtype": str(ex.dtype), "block_size": BLOCK_SIZE, "rounds": args.rounds,
        "bounds": f"weights+KV bytes / {hbm / 1e12:.2f} TB/s, or FLOPs / {flops / 1e12:.0f} TFLOP/s",
        "results": summary,
    }
    result["decode_split"] = split = decode_split(ex, args.tiny, args.rounds)
    result["goals"] = against_goals(summary, args.tiny, hbm, split)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(summary, out.with_suffix(".png"), result["decode_split"])
    if not args.no_profile:
        profile(ex, args.tiny, Path(f"{out}_profile.txt"))
        host_profile(ex, args.tiny, Path(f"{out}_host_profile.txt"))
    print(json.dumps(result["goals"], indent=1))
    for key, v in result["decode_split"].items():
        print(f"{key}: step {v['step_s'] * 1e3:.2f} ms = graph replay {v['graph_s'] * 1e3:.2f} ms "
              f"+ {(v['step_s'] - v['graph_s']) * 1e3:.2f} ms of host (host work alone {v['host_s'] * 1e3:.2f} ms); "
              f"launched ahead {v['ahead_s'] * 1e3:.2f} ms")
    return result


if __name__ == "__main__":
    main()
