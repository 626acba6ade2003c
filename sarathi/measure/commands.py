"""What each measurement `sarathi` subcommand does (bench, capacity, profile, plan, simulate),
given its parsed arguments (sarathi.cli dispatches here): where the load goes (a URL, a simulated
worker, or the real engine in this process), the workload, the SLO, and the result files.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from sarathi.cli_config import engine_config, scheduler_config, token_budget
from shared.config import CacheConfig


def _read_profile(path: str) -> dict:
    import json
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"profile file not found: {p} (write one with `sarathi profile`)")
    try:
        return json.loads(p.read_text())
    except ValueError:
        raise ValueError(f"{p} is not a profile JSON") from None


def _target(a: argparse.Namespace):
    """Where bench / capacity runs go: --url, a simulated worker, or the real engine here."""
    from sarathi.measure.tools import Target

    if a.url:
        return Target("http", url=a.url, api_key=a.api_key, served_model=a.served_model,
                      vocab_size=a.vocab_size)
    if a.executor == "sim":
        from sarathi.measure.tools import sim_target
        from shared.config import DEFAULT_CPU_BLOCKS

        return sim_target(_read_profile(a.profile) if a.profile else None,
                          block_size=a.block_size, num_blocks=a.num_blocks or DEFAULT_CPU_BLOCKS,
                          max_num_seqs=a.max_num_seqs,
                          max_num_batched_tokens=a.max_num_batched_tokens,
                          enable_prefix_caching=a.prefix_caching)
    from sarathi.llm import LLM

    llm = LLM.from_config(engine_config(a), scheduler_config(a, _slo(a)))
    info = llm.model_info

    def make_real(policy: str, tau: int):
        return llm.make_engine(dataclasses.replace(llm.scheduler_config, policy=policy, token_budget=tau))
    return Target("real", make_engine=make_real, max_model_len=info.max_model_len,
                  vocab_size=info.vocab_size)


def _workload(a: argparse.Namespace, max_total_len: int):
    from sarathi.measure.tools import Workload
    from sarathi.measure.trace import load_trace

    trace = load_trace(a.trace, prompt_column=a.prompt_column, output_column=a.output_column,
                       length_scale=a.length_scale, max_total_len=max_total_len)
    if a.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {a.num_requests}")
    if a.duration < 0:
        raise ValueError(f"--duration must be >= 0 seconds, got {a.duration}")
    return Workload(trace, a.num_requests, a.arrival, a.cv, a.burst_size, a.seed, a.drain, a.duration)


def _slo(a: argparse.Namespace) -> float | None:
    if a.tbt_slo > 0:
        return a.tbt_slo
    if a.tbt_slo < 0:
        raise ValueError(f"--tbt-slo must be > 0 seconds, got {a.tbt_slo}")
    if a.slo:
        if not a.profile:
            raise ValueError("--slo strict|relaxed needs --profile (the SLOs come from it)")
        return _read_profile(a.profile)["slo"][f"{a.slo}_s"]
    return None


def _qps_list(raw: str) -> list[float]:
    try:
        qps = [float(x) for x in str(raw).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--qps must be numbers separated by commas, got {raw!r}") from None
    if not qps or any(not q > 0 for q in qps):
        raise ValueError(f"--qps must be > 0, got {raw!r}")
    return qps


def _report(kind: str, result: dict, out: str | None, default: str) -> None:
    from sarathi.measure.tools import PLOTS, write_result

    paths = write_result(out or default, result, PLOTS[kind])
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)


def _header(a: argparse.Namespace, target, w=None) -> dict:
    from sarathi.measure.env import command_line, machine

    h = {"command": command_line(), "machine": machine(), "target": target.kind}
    if target.kind == "http":
        h["url"] = target.url
    if w is not None:
        h["workload"] = {"trace": w.trace.source, "num_requests": w.num_requests,
                         "arrival": w.arrival, "cv": w.cv, "burst_size": w.burst_size,
                         "seed": w.seed, "drain_s": w.drain_s, "duration_s": w.duration_s}
    if target.kind == "sim":
        h["cost_model"] = a.profile or "synthetic linear_cost_model()"
    return h


def _prepare(a: argparse.Namespace):
    """What bench and capacity share: (SLO, token budget, target, workload, result header)."""
    slo, target = _slo(a), _target(a)
    tau = token_budget(a, slo).budget
    w = _workload(a, target.max_model_len)
    return slo, tau, target, w, _header(a, target, w)


def bench(a: argparse.Namespace) -> int:
    from sarathi.measure.tools import run_once

    qps = _qps_list(a.qps)
    slo, tau, target, w, result = _prepare(a)
    result.update(tbt_slo_s=slo, runs=[])
    for q in qps:
        run = run_once(target, w, q, policy=a.policy, token_budget=tau, progress=a.progress,
                       keep_requests=a.details)
        result["runs"].append(run)
        s = run["summary"]
        print(f"{q:g} QPS: TTFT P50 {s['ttft_p50_s']:.3f} s, P99 {s['ttft_p99_s']:.3f} s | "
              f"TBT P50 {s['tbt_p50_s']:.3f} s, P99 {s['tbt_p99_s']:.3f} s | "
              f"{s['output_tok_per_s']:.1f} out tok/s | {s['finished']}/{s['requests']} finished")
    _report("bench", result, a.out, f"sarathi-bench-{a.policy if target.kind != 'http' else 'http'}")
    return 0


def capacity(a: argparse.Namespace) -> int:
    from sarathi.measure.tools import capacity as search

    if _slo(a) is None:
        raise ValueError("capacity needs a TBT SLO: --tbt-slo SECONDS, or --slo strict|relaxed with --profile")
    slo, tau, target, w, result = _prepare(a)
    result.update(search(target, w, slo, policy=a.policy, token_budget=tau, qps_start=a.qps_start,
                         resolution=a.resolution, max_sched_delay_s=a.max_sched_delay,
                         max_ttft_p50_s=a.max_ttft_p50 or None, progress=a.progress))
    print(f"capacity: {result['capacity_qps']:.4g} QPS (P99 TBT <= {slo:.3g} s, P50 scheduling "
          f"delay <= {a.max_sched_delay:g} s; resolution {a.resolution:.0%}, "
          f"{result['run_length']}, {len(result['probes'])} probes)")
    _report("capacity", result, a.out, f"sarathi-capacity-{a.policy if target.kind != 'http' else 'http'}")
    return 0


def profile(a: argparse.Namespace) -> int:
    import time

    from sarathi.measure.env import command_line, machine
    from sarathi.measure.profile import blocks_needed, cases, run_profile

    if not a.length_scale > 0:
        raise ValueError(f"--length-scale must be > 0, got {a.length_scale}")
    ctx = a.slo_context or max(4, round(4096 * a.length_scale))
    need = blocks_needed(cases(ctx, a.quick), a.block_size)
    if a.executor == "sim":
        from scheduler_svc.sim_executor import SimClock, SimExecutor, linear_cost_model

        clock = SimClock()
        ex = SimExecutor(a.block_size, verify_kv=False, cost_model=linear_cost_model(), clock=clock)
        info = {"name": "sim", "max_model_len": 8192, "vocab_size": 32000, "eos_token_ids": [0]}
    else:
        from worker_svc.model_runner import ModelRunner

        # every engine flag counts (it used to take only model, dtype and threads)
        ex = ModelRunner(dataclasses.replace(engine_config(a), cache=CacheConfig(a.block_size, need)))
        clock = time.perf_counter
        mi = ex.model_info
        info = {"name": mi.name, "max_model_len": mi.max_model_len, "vocab_size": mi.vocab_size,
                "eos_token_ids": list(mi.eos_token_ids)}
    from tqdm import tqdm

    total = len(cases(ctx, a.quick)) * (a.rounds + 1)
    with tqdm(total=total, desc="profile", unit="case", file=sys.stderr, disable=not a.progress,
              leave=False) as bar:
        res = run_profile(ex.execute, clock, block_size=a.block_size, slo_context=ctx,
                          rounds=a.rounds, quick=a.quick, on_case=bar.update)
    result = {"command": command_line(), "machine": machine(), "executor": a.executor,
              "dtype": a.dtype, "threads": a.threads, "model_info": info, **res}
    slo = res["slo"]
    print(f"decode-only batch 32 at {ctx}-token contexts: {slo['decode_b32_s'] * 1e3:.1f} ms -> "
          f"strict SLO {slo['strict_s']:.3f} s, relaxed {slo['relaxed_s']:.3f} s; cost model "
          f"mean error {res['cost_model']['fit_error']['mean_rel']:.1%}")
    _report("profile", result, a.out, "sarathi-profile")
    return 0


def plan(a: argparse.Namespace) -> int:
    from pathlib import Path

    from sarathi.measure.env import command_line, machine
    from sarathi.measure.plan import plan_disagg_threshold, plan_token_budget
    from sarathi.measure.profile import load_cost_model

    if a.device:   # a simulated GPU instead of a measured profile
        from sarathi.measure.profile import RELAXED, STRICT

        model, desc, base, _ = _sim_cost_model(a)
        prof = {"slo": {"context": 4096}}
        slo = a.tbt_slo if a.tbt_slo > 0 else (
            {"strict": STRICT, "relaxed": RELAXED}[a.slo] * base if a.slo else None)
    else:
        prof = _read_profile(a.profile)
        slo = _slo(a)
        model, desc = load_cost_model(prof), None
    if slo is None:
        raise ValueError("plan needs a TBT SLO: --tbt-slo SECONDS or --slo strict|relaxed")
    mean_out = None
    if a.qps:
        from sarathi.measure.trace import load_trace

        t = load_trace(a.trace, output_column=a.output_column, length_scale=a.length_scale)
        mean_out = sum(t.output_lens) / len(t)
    res = plan_token_budget(model, slo, context=a.context or prof["slo"]["context"],
                            tile=a.tile, decode_batch=a.decode_batch, qps=a.qps or None,
                            mean_output_tokens=mean_out, max_num_seqs=a.max_num_seqs)
    kv_bytes = a.kv_bytes_per_token or (model.shape.kv_bytes_per_token(model.shape.num_layers, 1)
                                        if a.device else 0)
    disagg = plan_disagg_threshold(model, slo, context=res["context"], decode_batch=res["decode_batch"],
                                   tile=a.tile, kv_bytes_per_token=kv_bytes, kv_link_gbs=a.kv_link_gbs)
    result = {"command": command_line(), "machine": machine(),
              **({"simulated": desc} if desc else {"profile": a.profile}), **res,
              "disagg_threshold": disagg["disagg_threshold"], "disagg": disagg}
    out = Path(a.out if a.out.endswith(".json") else a.out + ".json")
    _report("plan", result, str(out), str(out))
    print(f"token budget {res['token_budget']} (predicted iteration {res['iteration_s']:.3f} s "
          f"with {res['decode_batch']} decodes at {res['context']} tokens; SLO {slo:.3f} s) -> {out}")
    xfer = (f"; its KV ({disagg['kv_bytes'] / 1e6:.1f} MB) takes {disagg['kv_transfer_s'] * 1e3:.2f} ms over "
            f"{a.kv_link_gbs:g} GB/s" if disagg["kv_transfer_s"] is not None else "")
    print(f"disaggregation threshold {disagg['disagg_threshold']} tokens (--disagg-threshold): a whole prompt "
          f"of that length beside {disagg['decode_batch']} decodes is predicted at "
          f"{disagg['iteration_s']:.3f} s <= the SLO{xfer}")
    return 0


# -- simulation -------------------------------------------------------------------------------
def _sim_cost_model(a: argparse.Namespace):
    """(cost model, description, SLO base seconds or None, default KV blocks) of `simulate` / `plan`:
    the GPU model of --device/--model/--tp/--pp, or the fitted CPU model of --profile."""
    if getattr(a, "profile", None) and a.cmd == "simulate":
        from sarathi.measure.profile import load_cost_model

        prof = _read_profile(a.profile)
        if a.tp != 1 or a.pp != 1:
            raise ValueError("a --profile cost model is one CPU worker: --tp and --pp must be 1")
        return (load_cost_model(prof), {"kind": "profile", "profile": a.profile},
                prof["slo"]["decode_b32_s"], None)
    from sarathi.measure.gpu_costmodel import GPUCostModel, slo_decode_s

    m = GPUCostModel(a.model, a.device, tp=a.tp, pp=a.pp, topology=a.topology)
    ctx = max(4, round(4096 * getattr(a, "length_scale", 1.0)))
    blocks = m.kv_blocks(a.block_size, a.gpu_memory_utilization) if hasattr(a, "block_size") else None
    return m, {**m.describe(), "slo_context": ctx}, slo_decode_s(m, ctx), blocks


def _sim_roles(a: argparse.Namespace) -> list[str] | None:
    """The pools of `simulate`: None for --replicas (independent replicas), else one role per
    pool: --prefill-replicas x prefill + --decode-replicas x decode."""
    if a.prefill_replicas < 0 or a.decode_replicas < 0:
        raise ValueError("--prefill-replicas and --decode-replicas must be >= 0")
    if not a.prefill_replicas and not a.decode_replicas:
        if a.disaggregation != "off":
            raise ValueError("--disaggregation all|auto needs --prefill-replicas and --decode-replicas")
        return None
    if a.replicas != 1:
        raise ValueError("give either --replicas or --prefill-replicas/--decode-replicas")
    if a.disaggregation != "off" and not (a.prefill_replicas and a.decode_replicas):
        raise ValueError("--disaggregation all|auto needs at least one prefill and one decode replica")
    return ["prefill"] * a.prefill_replicas + ["decode"] * a.decode_replicas


def _chat_shape(a: argparse.Namespace):
    """The ChatShape of --workload chat (None for --workload trace)."""
    if getattr(a, "workload", "trace") != "chat":
        return None
    from sarathi.measure.loadgen import ChatShape

    try:
        lo, hi = (int(x) for x in str(a.chat_turns).split(","))
    except ValueError:
        raise ValueError(f"--chat-turns must be MIN,MAX, got {a.chat_turns!r}") from None
    if not 1 <= lo <= hi or a.chat_system_prompts < 1 or a.chat_system_len < 0 or not a.chat_user_scale > 0 \
            or a.chat_think < 0:
        raise ValueError("chat workload: need 1 <= min turns <= max turns, >= 1 system prompt, a system length "
                         ">= 0, --chat-user-scale > 0 and --chat-think >= 0")
    shape = ChatShape(a.chat_system_prompts, a.chat_system_len, (lo, hi), a.chat_user_scale, a.chat_think,
                      wait_for_answer=getattr(a, "chat_wait_for_answer", False))
    # warm the replicas up with one mean conversation's span of earlier turns (left out of the results)
    span = shape.mean_turns * (400 * shape.answer_s_per_token + shape.think_s)
    return dataclasses.replace(shape, warmup_s=round(span, 1))


def _kv_bytes_per_token(a: argparse.Namespace, desc: dict, cost, needed_by: str) -> int:
    """The KV bytes a token moves over the simulated link (for `needed_by`, an option's name):
    --kv-bytes-per-token, else the --device model's; a --profile run must give it, since a
    profile does not record its model's KV size."""
    if a.kv_bytes_per_token < 0:
        raise ValueError(f"--kv-bytes-per-token must be >= 0, got {a.kv_bytes_per_token}")
    if desc["kind"] != "gpu" and not a.kv_bytes_per_token:
        raise ValueError("a --profile does not record its model's KV size: give --kv-bytes-per-token with "
                         f"{needed_by} (SmolLM2-135M's bf16 KV: 23040)")
    return a.kv_bytes_per_token or cost.shape.kv_bytes_per_token(cost.shape.num_layers, 1)


def simulate(a: argparse.Namespace) -> int:
    from sarathi.measure.env import command_line, machine
    from sarathi.measure.profile import RELAXED, STRICT
    from sarathi.measure.simulate import pool_target, simulated_target
    from sarathi.measure.tools import capacity as search
    from sarathi.measure.tools import run_once

    if a.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {a.replicas}")
    if not 0.0 <= a.spec_acceptance <= 1.0:
        raise ValueError(f"--spec-acceptance must be in [0, 1], got {a.spec_acceptance}")
    if getattr(a, "async_scheduling", False) and getattr(a, "profile", None):
        raise ValueError("--async-scheduling is modelled with the GPU cost model (its host term runs "
                         "beside the batch before); a --profile cost model has no host term apart")
    cost, desc, slo_base, blocks = _sim_cost_model(a)
    num_blocks = a.num_blocks or blocks or 2048
    slo = a.tbt_slo if a.tbt_slo > 0 else (
        {"strict": STRICT, "relaxed": RELAXED}[a.slo] * slo_base if a.slo else None)
    tau = token_budget(a, slo)
    sched = scheduler_config(a, slo)
    max_len = 8192 if desc["kind"] == "gpu" else _read_profile(a.profile)["model_info"]["max_model_len"]
    roles = _sim_roles(a)
    if roles is None:
        if a.routing in ("prefix", "mix") and not sched.enable_prefix_caching:
            raise ValueError(f"--routing {a.routing} scores the prefix cache: add --prefix-caching")
        if a.kv_tier_blocks < 0:
            raise ValueError(f"--kv-tier-blocks must be >= 0, got {a.kv_tier_blocks}")
        if a.kv_tier_blocks and not sched.enable_prefix_caching:
            raise ValueError("--kv-tier-blocks shares cached prefixes between replicas: add --prefix-caching")
        tier_bytes = _kv_bytes_per_token(a, desc, cost, "--kv-tier-blocks") if a.kv_tier_blocks else 0
        target = simulated_target(cost, replicas=a.replicas, depth=a.pp, block_size=a.block_size,
                                  num_blocks=num_blocks, max_model_len=max_len, sched_config=sched,
                                  description=desc, windows=a.windows, noise_sigma=a.noise_sigma,
                                  spec_acceptance=a.spec_acceptance, routing=a.routing,
                                  kv_tier_blocks=a.kv_tier_blocks, tier_load_overlap=a.kv_tier_overlap,
                                  kv_bytes_per_token=tier_bytes, kv_link_gbs=a.kv_link_gbs)
        desc = {**desc, "routing": a.routing}
        if a.kv_tier_blocks:
            desc["kv_tier"] = {"blocks": a.kv_tier_blocks, "overlap": a.kv_tier_overlap,
                               "kv_bytes_per_token": tier_bytes, "link_gbs": a.kv_link_gbs}
    else:
        if a.kv_tier_blocks:
            raise ValueError("--kv-tier-blocks is modelled for --replicas (independent replicas), not pools")
        kv_bytes = _kv_bytes_per_token(a, desc, cost, "--prefill-replicas/--decode-replicas")
        target = pool_target(cost, roles=roles, mode=a.disaggregation, threshold_tokens=a.disagg_threshold,
                             backlog_margin_tokens=a.disagg_backlog_margin,
                             prefill_token_budget=a.prefill_token_budget, depth=a.pp,
                             block_size=a.block_size, num_blocks=num_blocks, max_model_len=max_len,
                             kv_bytes_per_token=kv_bytes, kv_link_gbs=a.kv_link_gbs, sched_config=sched,
                             description=desc, noise_sigma=a.noise_sigma, keep_transfers=a.details)
        desc = {**desc, "pools": roles, "disaggregation": a.disaggregation,
                "disagg_threshold": a.disagg_threshold, "disagg_backlog_margin": a.disagg_backlog_margin,
                "prefill_token_budget": a.prefill_token_budget or None, "kv_link_gbs": a.kv_link_gbs,
                "kv_bytes_per_token": kv_bytes,
                "kv_link_assumption": f"{a.kv_link_gbs:g} GB/s between workers (25 GB/s = one 200 Gb/s "
                                      "RDMA NIC); transfer = prompt blocks x block size x KV bytes per token / link"}
    w = dataclasses.replace(_workload(a, max_len), shift_prompt_scale=a.shift_prompt_scale,
                            chat=_chat_shape(a))
    label = f"{a.policy} tau={'adaptive' if tau.adaptive_slo else tau.budget}"
    result = {"command": command_line(), "machine": machine(), "target": "sim",
              "simulated": {**desc, "replicas": a.replicas if roles is None else len(roles),
                            "num_blocks": num_blocks,
                            "noise_sigma": a.noise_sigma,
                            "speculative": a.speculative, "spec_acceptance": a.spec_acceptance,
                            "slo_base_decode_b32_s": slo_base},
              "workload": {"trace": w.trace.source, "num_requests": w.num_requests, "arrival": w.arrival,
                           "cv": w.cv, "burst_size": w.burst_size, "seed": w.seed, "drain_s": w.drain_s,
                           "duration_s": w.duration_s, "shift_prompt_scale": w.shift_prompt_scale,
                           "chat": dataclasses.asdict(w.chat) if w.chat else None},
              "tbt_slo_s": slo, "adaptive_tbt_slo_s": tau.adaptive_slo}
    if a.capacity:
        if slo is None:
            raise ValueError("--capacity needs a TBT SLO: --tbt-slo SECONDS or --slo strict|relaxed")
        result.update(search(target, w, slo, policy=a.policy, token_budget=tau.budget, qps_start=a.qps_start,
                             resolution=a.resolution, max_sched_delay_s=a.max_sched_delay,
                             progress=a.progress))
        result["label"] = label
        print(f"capacity: {result['capacity_qps']:.4g} QPS ({label}, {a.replicas} replica(s); P99 TBT <= "
              f"{slo:.3g} s, P50 scheduling delay <= {a.max_sched_delay:g} s; {len(result['probes'])} probes)")
        _report("capacity", result, a.out, f"sarathi-simulate-capacity-{a.policy}")
        return 0
    result["runs"] = []
    for q in _qps_list(a.qps):
        run = run_once(target, w, q, policy=a.policy, token_budget=tau.budget, progress=a.progress,
                       keep_requests=a.details)
        result["runs"].append(run)
        s = run["summary"]
        print(f"{q:g} QPS: TTFT P50 {s['ttft_p50_s']:.3f} s, P99 {s['ttft_p99_s']:.3f} s | "
              f"TBT P50 {s['tbt_p50_s']:.4f} s, P99 {s['tbt_p99_s']:.4f} s | "
              f"sched delay P50 {s['sched_delay_p50_s']:.3f} s | "
              f"{s['finished']}/{s['requests']} finished"
              + (f" | prefix hits {s['prefix_hit_rate']:.1%}" if "prefix_hit_rate" in s else "")
              + (f" | PP bubbles {s['pp_bubble_fraction']:.1%}" if a.pp > 1 and "pp_bubble_fraction" in s else "")
              + (f" | {s['disaggregated_requests']} disaggregated, KV transfer P50 "
                 f"{s['kv_transfer_p50_s'] * 1e3:.2f} ms = {s['kv_transfer_share_of_ttft_p50']:.1%} of their "
                 f"P50 TTFT {s['disagg_ttft_p50_s']:.3f} s" if s.get("disaggregated_requests") else ""))
    _report("bench", result, a.out, f"sarathi-simulate-{a.policy}")
    return 0
