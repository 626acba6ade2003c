"""What each serving `sarathi` subcommand does (generate, serve, gateway, scheduler, worker), given
its parsed arguments (sarathi.cli). The measurement subcommands are sarathi.measure.commands."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from sarathi.cli_config import engine_config, scheduler_config
from shared.config import (
    DisaggConfig,
    GatewayConfig,
    ParallelConfig,
    SchedulerServiceConfig,
    ServeConfig,
    WorkerServiceConfig,
)
from shared.sampling import SamplingParams


def generate(a: argparse.Namespace) -> int:
    from sarathi.llm import LLM

    llm = LLM.from_config(engine_config(a), scheduler_config(a))
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


def serve(a: argparse.Namespace) -> int:
    from sarathi.serve import run_embedded

    if getattr(a, "async_scheduling", False) and (a.prefill_workers or a.decode_workers):
        raise ValueError("--async-scheduling does not combine with prefill/decode workers "
                         "(disaggregation): use it with colocated workers")
    run_embedded(ServeConfig(
        worker=engine_config(a), scheduler=scheduler_config(a), host=a.host, port=a.port,
        redis_url=a.redis_url, queue_prefix=a.queue_prefix, max_model_len=a.max_model_len or None,
        api_key=_api_key(a), allow_unauthenticated=a.allow_unauthenticated,
        parse_control_tokens=a.parse_control_tokens, drain_timeout_s=a.drain_timeout,
        worker_restart_timeout_s=a.worker_restart_timeout,
        workers=a.workers if (a.workers != 1 or not a.prefill_workers) else 0,
        prefill_workers=a.prefill_workers, decode_workers=a.decode_workers,
        disaggregation=a.disaggregation, disagg_threshold=a.disagg_threshold,
        disagg_backlog_margin=a.disagg_backlog_margin, kv_transfer_timeout_s=a.kv_transfer_timeout,
        kv_transfer_failure=a.kv_transfer_failure, scheduler_port=a.scheduler_port))
    return 0


def gateway(a: argparse.Namespace) -> int:
    from gateway.server import run_gateway

    if not a.redis_url:
        raise ValueError("the gateway service needs --redis-url (or SARATHI_REDIS_URL); "
                         "for one process use `sarathi serve`")
    run_gateway(GatewayConfig(
        model=a.model, redis_url=a.redis_url, queue_prefix=a.queue_prefix, host=a.host, port=a.port,
        api_key=_api_key(a), allow_unauthenticated=a.allow_unauthenticated,
        parse_control_tokens=a.parse_control_tokens, max_queue_depth=a.max_queue_depth,
        max_model_len=a.max_model_len or None, drain_timeout_s=a.drain_timeout))
    return 0


def _api_key(a: argparse.Namespace) -> str | None:
    from gateway.server import read_api_key

    return read_api_key(a.api_key, a.api_key_file)


def scheduler(a: argparse.Namespace) -> int:
    import logging

    from scheduler_svc.service import run_scheduler

    # INFO: the start-up line (policy, budget, model, KV cache, workers) is for operators
    if not logging.getLogger().handlers:
        logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not a.redis_url:
        raise ValueError("the scheduler service needs --redis-url (or SARATHI_REDIS_URL)")
    def addrs(value: str) -> list[str]:
        return [w.strip() for w in (value or "").split(",") if w.strip()]

    prefill, decode = addrs(a.prefill_worker_addrs), addrs(a.decode_worker_addrs)
    explicit_mixed = (any(arg.startswith("--worker-addr") for arg in sys.argv)
                      or "SARATHI_WORKER_ADDR" in os.environ)
    run_scheduler(SchedulerServiceConfig(
        scheduler=scheduler_config(a), max_model_len=a.max_model_len or None, redis_url=a.redis_url,
        queue_prefix=a.queue_prefix, consumer=a.consumer,
        # with prefill/decode workers, --worker-addr names mixed workers only when given
        worker_addrs=addrs(a.worker_addr) if (explicit_mixed or not (prefill or decode)) else [],
        worker_restart_timeout_s=a.worker_restart_timeout, metrics_port=a.metrics_port,
        stall_timeout_s=a.stall_timeout,
        disagg=DisaggConfig(prefill, decode, separate_mixed=bool(prefill or decode), mode=a.disaggregation,
                            threshold_tokens=a.disagg_threshold, backlog_margin_tokens=a.disagg_backlog_margin,
                            kv_transfer_timeout_s=a.kv_transfer_timeout,
                            kv_transfer_failure=a.kv_transfer_failure)))
    return 0


def worker(a: argparse.Namespace) -> int:
    import logging

    from worker_svc.service import run_worker

    # INFO: the worker's start-up lines (which backend and kernels run, the KV cache) are for operators
    if not logging.getLogger().handlers:
        logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = dataclasses.replace(engine_config(a), max_num_seqs=a.max_num_seqs,
                                 max_num_batched_tokens=a.max_num_batched_tokens)
    config = WorkerServiceConfig(engine, address=a.bind, role=a.role, kv_address=a.kv_address or None)
    rank = a.rank if a.rank >= 0 else _env_int("RANK")
    if a.tp * a.pp == 1 and rank is None and not a.pp_layers:
        from kvstore.link import make_kv_link

        run_worker(config, kv_link=make_kv_link)
        return 0
    if a.role != "mixed" or a.kv_address:
        raise ValueError("prefill/decode roles run on one-rank workers only (no --tp/--pp yet)")
    from worker_svc.parallel import parse_pp_layers

    pc = ParallelConfig(tp=a.tp, pp=a.pp, rank=max(rank or 0, 0), pp_layers=parse_pp_layers(a.pp_layers),
                        master_addr=a.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1",
                        master_port=a.master_port or _env_int("MASTER_PORT") or 0,
                        timeout_s=a.dist_timeout)
    if rank is None:   # every rank of the replica on this machine, one process each
        from worker_svc.launcher import launch_local
        return launch_local(dataclasses.replace(config, parallel=pc))
    from shared.model_source import resolve_model
    from worker_svc import parallel as par
    from worker_svc.loader import read_config

    world = a.world_size or _env_int("WORLD_SIZE") or pc.world_size
    local = _env_int("LOCAL_RANK")
    if a.device == "cuda" and local is not None:
        engine = dataclasses.replace(engine, device=f"cuda:{local}")     # torchrun: one GPU per local rank
    pc = dataclasses.replace(pc, master_port=pc.master_port or 29500)
    par.check(read_config(resolve_model(a.model)), pc, world)   # before any weight is read
    run_worker(WorkerServiceConfig(engine, address=a.bind, parallel=pc))
    return 0


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def keys(a: argparse.Namespace) -> int:
    """`sarathi keys DIR`: a deployment's link keys (shared.link_auth.write_key_set)."""
    from shared.link_auth import write_key_set

    for path in write_key_set(a.out, force=a.force):
        print(path)
    return 0
