"""One load point per policy on a GPU with the real engine, and the same points in the simulator.

    python -m bench.gpu_load_point [--qps 8] [--num-requests 64] [--policies sarathi,vllm]
                                   [--out bench/results/gpu/gpu_load_point]

The real engine: the scheduler (EngineLoop) over the CUDA model runner (FlashInfer, CUDA graphs,
KV cache sized from free memory) with random-init Llama-3-8B weights at full shapes, vocabulary
128256 included, bf16, made on the device (bench.gpu_engine_iteration.random_weights). The
workload: the shipped ShareGPT-4 length trace at full length (prompts + outputs up to 4096
tokens), Poisson arrivals at --qps, prompts of random token ids, ignore_eos (every request makes
its trace output length). Each policy gets a fresh scheduler over the same executor.

The simulator: `sarathi simulate --device h100 --model llama-3-8b` (the GPU cost model) on the
same workload, seed, QPS and scheduler limits. It is also evaluated on every real iteration's
exact shapes (each sequence's start, new tokens, decode or not; recorded around execute()), so
the cost model's error is per iteration, not only in the latency percentiles.

Writes <out>.json (per policy: real summary and iterations, simulated summary, per-iteration
model error) and <out>.png (TTFT / TBT percentiles, real vs simulated, per policy).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.gpu_engine_iteration import gpu_info, llama3_8b_config, random_weights, tiny_config
from sarathi.measure.simulate import simulated_target
from sarathi.measure.tools import Target, Workload, run_once
from sarathi.measure.trace import load_trace
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.scheduler import Scheduler
from shared.config import CacheConfig, SchedulerConfig, WorkerConfig
from worker_svc.model_runner import ModelRunner

BLOCK_SIZE = 16
MAX_LEN = 4096


def build(args) -> tuple[ModelRunner, object]:
    """The 8B on CUDA (KV sized from memory), or with --tiny a tiny model on the CPU (512 blocks)."""
    if args.tiny:
        cfg, dtype, device, blocks = tiny_config(), torch.float32, "cpu", 512
    else:
        cfg = llama3_8b_config(vocab_size=128256, max_position_embeddings=MAX_LEN)
        dtype, device, blocks = torch.bfloat16, "cuda:0", 0
    wc = WorkerConfig(dtype=str(dtype).removeprefix("torch."), device=device.split(":")[0],
                      cache=CacheConfig(BLOCK_SIZE, blocks), gpu_memory_utilization=args.gpu_memory_utilization,
                      cuda_graphs=True, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens)
    return ModelRunner(wc, weights=(cfg, random_weights(cfg, dtype, device))), cfg


def sched_config(args, policy: str) -> SchedulerConfig:
    """policy: a policy name, with "+async" for async scheduling (e.g. sarathi+async)."""
    name, _, extra = policy.partition("+")
    if extra not in ("", "async"):
        raise SystemExit(f"unknown policy option {extra!r} in {policy!r} (only +async)")
    return SchedulerConfig(policy=name, token_budget=args.token_budget, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=MAX_LEN,
                           async_scheduling=extra == "async")


class Recording:
    """The executor, recording each batch's shapes (start, new tokens, is_decode per sequence)
    and the seconds execute() took (synchronous: it ends with token ids on the host). With async
    scheduling the loop calls launch()/finish() instead (passed through): nothing is recorded."""

    def __init__(self, ex: ModelRunner):
        self.ex, self.log = ex, []

    def __getattr__(self, name):
        return getattr(self.ex, name)

    def execute(self, batch):
        t0 = time.perf_counter()
        out = self.ex.execute(batch)
        shapes = [(s.start_pos, len(s.token_ids), s.is_decode) for s in batch.seqs]
        self.log.append((shapes, time.perf_counter() - t0))
        return out


def iteration_error(cost, log: list, scale: float = 1.0) -> dict:
    """The cost model's time for each real iteration (its exact shapes) over the measured time;
    scale multiplies the prediction (an H100 model read on a faster-memory GPU)."""
    ratios = sorted(scale * cost.predict_shapes(shapes) / dt for shapes, dt in log if dt > 0)
    if not ratios:
        return {}
    n = len(ratios)
    return {"iterations": n, "pred_over_real_p50": statistics.median(ratios),
            "pred_over_real_p10": ratios[n // 10], "pred_over_real_p90": ratios[9 * n // 10],
            "pred_over_real_mean": sum(ratios) / n}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pols = list(result["policies"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (metric, label) in zip(axes, (("ttft", "TTFT (s)"), ("tbt", "TBT (ms)"))):
        scale = 1e3 if metric == "tbt" else 1.0
        for k, (src, style) in enumerate((("real", "C0"), ("simulated", "C1"))):
            for j, p in enumerate(("p50", "p99")):
                vals = [result["policies"][pol][src]["summary"].get(f"{metric}_{p}_s", float("nan")) * scale
                        for pol in pols]
                xs = [i + 0.2 * (2 * k + j) - 0.3 for i in range(len(pols))]
                ax.bar(xs, vals, width=0.18, color=style, alpha=1.0 if p == "p50" else 0.5,
                       label=f"{src} {p.upper()}")
        ax.set_xticks(range(len(pols)), pols)
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['qps']:g} QPS, {result['num_requests']} ShareGPT requests: real ({result['gpu']}) "
                 f"vs simulated H100", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qps", type=float, default=8.0)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--policies", default="sarathi,vllm",
                    help="comma-separated; a name with +async runs it with async scheduling (sarathi+async)")
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--drain", type=float, default=30.0, help="seconds after the last arrival")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU, lengths / 32 (smoke test)")
    ap.add_argument("--out", default="bench/results/gpu/gpu_load_point")
    args = ap.parse_args(argv)
    from sarathi.measure.gpu_costmodel import GPUCostModel

    t0 = time.perf_counter()
    ex, cfg = build(args)
    info = ex.model_info
    print(f"executor ready in {time.perf_counter() - t0:.1f} s: {info.num_blocks} KV blocks; {info.backend}",
          flush=True)
    trace = load_trace(None, max_total_len=MAX_LEN, length_scale=1 / 32 if args.tiny else 1.0)
    w = Workload(trace, args.num_requests, seed=args.seed, drain_s=args.drain)
    cost = GPUCostModel("llama-3-8b", "h100")
    out = Path(args.out)
    result = {"command": "python -m bench.gpu_load_point " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": gpu_info(), "backend": info.backend, "num_blocks": info.num_blocks,
              "model": "random-init " + ("tiny Llama, fp32" if args.tiny else "Llama-3-8B shapes (vocab 128256), bf16"),
              "qps": args.qps,
              "num_requests": args.num_requests, "workload": {"trace": trace.source, "seed": args.seed,
                                                              "drain_s": args.drain, "max_total_len": MAX_LEN},
              "simulator": cost.describe(), "policies": {}}
    for policy in args.policies.split(","):
        rec = Recording(ex)

        def make(pol: str, tau: int, policy=policy, rec=rec) -> EngineLoop:
            sc = dataclasses.replace(sched_config(args, policy), token_budget=tau)
            return EngineLoop(Scheduler(sc, CacheConfig(BLOCK_SIZE, info.num_blocks), info), rec)
        name = sched_config(args, policy).policy
        real = run_once(Target("real", make_engine=make, max_model_len=MAX_LEN, vocab_size=info.vocab_size),
                        w, args.qps, policy=name, token_budget=args.token_budget, progress=False)
        sim_target = simulated_target(cost, block_size=BLOCK_SIZE, num_blocks=info.num_blocks,
                                      max_model_len=MAX_LEN, vocab_size=info.vocab_size,
                                      sched_config=sched_config(args, policy))
        sim = run_once(sim_target, w, args.qps, policy=name, token_budget=args.token_budget, progress=False,
                       keep_requests=False)
        entry = {"real": {"summary": real["summary"], "iterations": real["iterations"],
                          "batches": [[shapes, round(dt, 6)] for shapes, dt in rec.log]},
                 "simulated": {"summary": sim["summary"]}}
        try:
            entry["cost_model_per_iteration"] = iteration_error(cost, rec.log)
        except Exception as e:        # redone offline from "batches" if need be
            entry["cost_model_per_iteration"] = {"error": f"{type(e).__name__}: {e}"}
        result["policies"][policy] = entry
        rs, ss = real["summary"], sim["summary"]
        print(f"{policy} @ {args.qps:g} QPS: real TTFT P50 {rs['ttft_p50_s']:.3f} s P99 {rs['ttft_p99_s']:.3f} s, "
              f"TBT P50 {rs['tbt_p50_s'] * 1e3:.1f} ms P99 {rs['tbt_p99_s'] * 1e3:.1f} ms, "
              f"{rs['finished']}/{rs['requests']} finished | simulated TTFT P50 {ss['ttft_p50_s']:.3f} s, "
              f"TBT P50 {ss['tbt_p50_s'] * 1e3:.1f} ms P99 {ss['tbt_p99_s'] * 1e3:.1f} ms", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))   # what was reached so far
    plot(result, out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
