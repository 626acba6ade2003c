"""What each `sarathi` subcommand does, given its parsed arguments (see sarathi.cli)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from shared.sampling import SamplingParams


def _llm_kwargs(a: argparse.Namespace) -> dict:
    return dict(dtype=a.dtype, threads=a.threads, num_blocks=a.num_blocks, block_size=a.block_size,
                **_device_kwargs(a), policy=a.policy, token_budget=a.token_budget, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=a.prefix_caching)


def _device_kwargs(a: argparse.Namespace) -> dict:
    return dict(device=a.device, gpu_memory_utilization=a.gpu_memory_utilization, cuda_graphs=a.cuda_graphs)


def generate(a: argparse.Namespace) -> int:
    from sarathi.llm import LLM

    llm = LLM(a.model, **_llm_kwargs(a))
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            max_tokens=a.max_tokens, seed=a.seed)
    if a.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in a.prompt], params)
    else:
        outs = llm.generate(list(a.prompt), params)
    for i, out in enumerate(outs):
        if len(outs) > 1:
            print(f"--- [{i}] finish_reason={out.finish_reason}")
        print(out.text)
        if out.output.error:
            print(f"error: {out.output.error}", file=sys.stderr)
    return 0


def _sched_kwargs(a: argparse.Namespace) -> dict:
    return dict(policy=a.policy, token_budget=a.token_budget, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, prefix_caching=a.prefix_caching,
                max_model_len=a.max_model_len or None, queue_prefix=a.queue_prefix)


def serve(a: argparse.Namespace) -> int:
    from sarathi.serve import run_embedded

    run_embedded(model=a.model, host=a.host, port=a.port, redis_url=a.redis_url, dtype=a.dtype,
                 threads=a.threads, num_blocks=a.num_blocks, block_size=a.block_size,
                 api_key=a.api_key, **_device_kwargs(a), **_sched_kwargs(a))
    return 0


def gateway(a: argparse.Namespace) -> int:
    from gateway.server import run_gateway

    if not a.redis_url:
        raise ValueError("the gateway service needs --redis-url (or SARATHI_REDIS_URL); "
                         "for one process use `sarathi serve`")
    run_gateway(a.model, redis_url=a.redis_url, host=a.host, port=a.port, api_key=a.api_key,
                max_queue_depth=a.max_queue_depth, max_model_len=a.max_model_len or None,
                queue_prefix=a.queue_prefix)
    return 0


def scheduler(a: argparse.Namespace) -> int:
    from scheduler_svc.service import run_scheduler

    if not a.redis_url:
        raise ValueError("the scheduler service needs --redis-url (or SARATHI_REDIS_URL)")
    run_scheduler(redis_url=a.redis_url, worker_addr=a.worker_addr.split(","), model=a.model,
                  metrics_port=a.metrics_port, consumer=a.consumer, **_sched_kwargs(a))
    return 0


def worker(a: argparse.Namespace) -> int:
    from worker_svc.service import run_worker

    kw = dict(address=a.bind, model=a.model, dtype=a.dtype, threads=a.threads,
              num_blocks=a.num_blocks, block_size=a.block_size, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, **_device_kwargs(a))
    rank = a.rank if a.rank >= 0 else _env_int("RANK")
    if a.tp * a.pp == 1 and rank is None and not a.pp_layers:
        run_worker(**kw)
        return 0
    import logging

    from worker_svc.parallel import ParallelConfig, parse_pp_layers

    if not logging.getLogger().handlers:
        logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")

    pc = ParallelConfig(tp=a.tp, pp=a.pp, rank=max(rank or 0, 0), pp_layers=parse_pp_layers(a.pp_layers),
                        master_addr=a.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1",
                        master_port=a.master_port or _env_int("MASTER_PORT") or 0,
                        timeout_s=a.dist_timeout)
    if rank is None:   # every rank of the replica on this machine, one process each
        from worker_svc.launcher import launch_local
        return launch_local(kw, pc)
    from shared.model_source import resolve_model
    from worker_svc import parallel as par
    from worker_svc.loader import read_config

    world = a.world_size or _env_int("WORLD_SIZE") or pc.world_size
    local = _env_int("LOCAL_RANK")
    if a.device == "cuda" and local is not None:
        kw["device"] = f"cuda:{local}"     # torchrun: one GPU per local rank
    pc = dataclasses.replace(pc, master_port=pc.master_port or 29500)
    par.check(read_config(resolve_model(a.model)), pc, world)   # before any weight is read
    run_worker(parallel=pc, **kw)
    return 0


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None
