"""The measurement tools as functions: what `sarathi bench | capacity | profile | plan` run.

A Target is where a run goes: an in-process engine (a fresh EngineLoop per run from
`make_engine(policy, token_budget)`, over the real executor or a simulated one) or an
OpenAI-compatible URL. The functions return plain dicts (the JSON the CLI writes) and show a
progress bar (tqdm, on stderr) while they run.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from sarathi.measure import plots
from sarathi.measure.capacity import search_capacity
from sarathi.measure.loadgen import (
    ChatShape,
    make_chat_workload,
    make_workload,
    run_http,
    run_inprocess,
    shift_prompts,
)
from sarathi.measure.metrics import json_safe, meets_slo, summarize
from sarathi.measure.trace import Trace
from scheduler_svc.engine_loop import EngineLoop


@dataclass
class Target:
    """kind: "real" (torch executor, wall clock), "sim" (SimExecutor + cost model, SimClock)
    or "http". make_engine(policy, token_budget) -> a fresh EngineLoop (in-process kinds).
    run(policy, token_budget, workload, drain_s, on_progress) -> (RunResult, extra summary
    fields): a target that drives its own engines (sarathi.measure.simulate: replicas, PP);
    description: what the result records about the target (e.g. its cost model)."""

    kind: str
    make_engine: Callable[[str, int], EngineLoop] | None = None
    run: Callable[..., tuple] | None = None
    description: dict | None = None
    url: str | None = None
    api_key: str | None = None
    served_model: str | None = None
    vocab_size: int = 32000
    max_model_len: int = 8192


@dataclass
class Workload:
    """The workload shape of a run (sarathi.measure.loadgen.make_workload's arguments but qps)."""

    trace: Trace
    num_requests: int
    arrival: str = "poisson"
    cv: float = 1.0
    burst_size: int = 8
    seed: int = 0
    drain_s: float = 60.0
    duration_s: float = 0.0   # > 0: a run is this many seconds of arrivals (qps x duration requests)
    shift_prompt_scale: float = 0.0   # > 0: prompts of the second half x this (loadgen.shift_prompts)
    chat: ChatShape | None = None     # multi-turn conversations instead of single requests (loadgen)

    def requests_at(self, qps: float) -> int:
        """Requests in a run at qps. A fixed duration keeps overload visible at any rate: the
        backlog of a run grows with its length, not with its request count."""
        return max(1, math.ceil(qps * self.duration_s)) if self.duration_s > 0 else self.num_requests


SYNTHETIC_INFO = {"name": "sim", "max_model_len": 8192, "vocab_size": 32000, "eos_token_ids": [0]}


def sim_target(profile: dict | None, *, block_size: int = 16, num_blocks: int = 2048,
               max_num_seqs: int = 128, max_num_batched_tokens: int = 4096,
               enable_prefix_caching: bool = False) -> Target:
    """A simulated worker: the real scheduler, iteration times from the profile's cost model
    (sarathi.measure.costmodel), the model's limits from the profile; without a profile, the synthetic
    linear_cost_model() (quick mode). The scheduler settings default to `sarathi serve`'s."""
    from sarathi.measure.profile import load_cost_model
    from scheduler_svc.sim_executor import linear_cost_model, sim_engine

    cost, info = linear_cost_model(), SYNTHETIC_INFO
    if profile is not None:
        cost, info = load_cost_model(profile), profile.get("model_info", SYNTHETIC_INFO)

    def make(policy: str, tau: int) -> EngineLoop:
        return sim_engine(policy, token_budget=tau, block_size=block_size, num_blocks=num_blocks,
                          max_num_seqs=max_num_seqs, max_model_len=info["max_model_len"],
                          max_num_batched_tokens=max_num_batched_tokens,
                          enable_prefix_caching=enable_prefix_caching, watermark=0.01,
                          eos_token_ids=tuple(info["eos_token_ids"]),
                          vocab_size=info["vocab_size"], verify_kv=False, cost_model=cost)
    return Target("sim", make_engine=make, max_model_len=info["max_model_len"],
                  vocab_size=info["vocab_size"])


def _bar(total: int, desc: str, progress: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=not progress,
                leave=False, dynamic_ncols=True)


def run_once(target: Target, w: Workload, qps: float, *, policy: str = "sarathi",
             token_budget: int = 512, progress: bool = True, keep_requests: bool = True) -> dict:
    """One open-loop run at qps: {"qps", "policy", "summary", "iterations", "requests"};
    keep_requests=False leaves out the per-request and per-iteration logs (summary only)."""
    engine = target.make_engine(policy, token_budget) if target.make_engine is not None else None
    vocab = engine.scheduler.model_info.vocab_size if engine else target.vocab_size
    n = w.requests_at(qps)
    if w.chat is not None:
        workload = make_chat_workload(w.trace, n, qps, w.chat, seed=w.seed, vocab_size=vocab,
                                      max_total_len=engine.scheduler.max_model_len if engine else target.max_model_len)
    else:
        workload = make_workload(w.trace, n, qps, arrival=w.arrival, cv=w.cv,
                                 burst_size=w.burst_size, seed=w.seed, vocab_size=vocab)
    if w.shift_prompt_scale > 0:
        workload = shift_prompts(workload, w.shift_prompt_scale, vocab_size=vocab, seed=w.seed,
                                 max_total_len=engine.scheduler.max_model_len if engine else target.max_model_len)
    in_process = target.kind != "http"
    extra = {}
    with _bar(n, f"{policy if in_process else 'http'} @ {qps:.3g} QPS", progress) as bar:
        if target.run is not None:
            rr, extra = target.run(policy, token_budget, workload, w.drain_s, bar.update)
        elif engine is None:
            rr = run_http(target.url, workload, drain_s=w.drain_s, model=target.served_model,
                          api_key=target.api_key, on_progress=bar.update)
        else:
            rr = run_inprocess(engine, workload, drain_s=w.drain_s, on_progress=bar.update)
    out = {"qps": qps, "policy": policy if in_process else None,
           "token_budget": token_budget if in_process else None,
           "summary": {**summarize(rr.records, rr.iterations, rr.end_time), **extra}}
    if keep_requests:
        out["iterations"] = [asdict(i) for i in rr.iterations]
        out["requests"] = [r.to_dict() for r in rr.records]
    return out


def capacity(target: Target, w: Workload, tbt_slo_s: float, *, policy: str = "sarathi",
             token_budget: int = 512, qps_start: float = 1.0, resolution: float = 0.05,
             max_sched_delay_s: float = 2.0, max_ttft_p50_s: float | None = None,
             progress: bool = True) -> dict:
    """Binary search on QPS for the paper's criterion (sarathi.measure.capacity,
    sarathi.measure.metrics.meets_slo)."""
    if not tbt_slo_s > 0:
        raise ValueError(f"--tbt-slo must be > 0 seconds, got {tbt_slo_s}")
    details = []

    def probe(qps: float) -> bool:
        run = run_once(target, w, qps, policy=policy, token_budget=token_budget,
                       progress=progress, keep_requests=False)
        ok = meets_slo(run["summary"], tbt_slo_s, max_sched_delay_s, max_ttft_p50_s)
        details.append({"qps": qps, "ok": ok, "summary": run["summary"]})
        if progress:
            s = run["summary"]
            print(f"  probe {qps:.4g} QPS: P99 TBT {s['tbt_p99_s']:.3g} s, P50 sched delay "
                  f"{s['sched_delay_p50_s'] if s['sched_delay_p50_s'] is None else round(s['sched_delay_p50_s'], 3)} s,"
                  f" P50 TTFT {s['ttft_p50_s']:.3g} s -> {'ok' if ok else 'miss'}", file=sys.stderr)
        return ok

    res = search_capacity(probe, qps_start=qps_start, resolution=resolution)
    res.update(probes=details, tbt_slo_s=tbt_slo_s, max_sched_delay_s=max_sched_delay_s,
               max_ttft_p50_s=max_ttft_p50_s, policy=policy if target.kind != "http" else None,
               token_budget=token_budget if target.kind != "http" else None,
               run_length=(f"{w.duration_s:g} s of arrivals per probe" if w.duration_s > 0
                           else f"{w.num_requests} requests per probe"), drain_s=w.drain_s,
               label=f"{policy} tau={token_budget}" if target.kind != "http" else target.url)
    return res


def write_result(prefix: str | Path, result: dict, plot: Callable[[dict, Path], None] | None) -> list[Path]:
    """prefix.json (strict JSON: inf -> "inf") and prefix.png; returns the paths written."""
    p = Path(prefix)
    if p.suffix in (".json", ".png"):
        p = p.with_suffix("")
    p.parent.mkdir(parents=True, exist_ok=True)
    paths = [p.with_suffix(".json")]
    paths[0].write_text(json.dumps(json_safe(result), indent=1))
    if plot is not None:
        try:
            plot(result, p.with_suffix(".png"))
            paths.append(p.with_suffix(".png"))
        except ImportError:
            print("note: matplotlib is not installed; no PNG written "
                  "(pip install 'sarathi-serve-py[bench]')", file=sys.stderr)
    return paths


PLOTS = {"bench": plots.plot_run, "capacity": plots.plot_capacity,
         "profile": plots.plot_profile, "plan": plots.plot_plan}
