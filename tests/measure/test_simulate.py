"""`sarathi simulate` (sarathi.measure.simulate): the unchanged scheduler against a simulated worker
on a virtual clock. Deterministic; a capacity search on a synthetic model finds the known answer;
the pipeline's bubbles are accounted exactly; replicas share the load; the adaptive token budget
keeps a synthetic SLO under a step change in prompt length where a fixed budget does not."""
from __future__ import annotations

import json

import pytest

from sarathi.cli import main
from sarathi.measure.costmodel import CostModel
from sarathi.measure.gpu_costmodel import GPUCostModel
from sarathi.measure.simulate import SimulatedWorker, simulated_target
from sarathi.measure.tools import Workload, capacity, run_once
from sarathi.measure.trace import load_trace
from scheduler_svc.sim_executor import SimClock
from shared.config import SchedulerConfig
from shared.messages import Batch, SeqChunk
from shared.sampling import SamplingParams


def fixed_trace(tmp_path, prompt: int, output: int, rows: int = 50):
    path = tmp_path / "trace.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n" + f"{prompt},{output}\n" * rows)
    return load_trace(path)


def constant_cost(seconds: float) -> CostModel:
    return CostModel([seconds, 0, 0, 0, 0, 0], knee=16)


def test_a_simulated_run_is_deterministic_and_takes_seconds():
    """Same inputs, same outputs: every token time of 150 ShareGPT requests on an A100 model."""
    model = GPUCostModel("llama-3-8b", "a100")
    w = Workload(load_trace(max_total_len=8192), 150, drain_s=30, seed=3)

    def once():
        target = simulated_target(model, num_blocks=model.kv_blocks(16))
        return run_once(target, w, 3.0, policy="sarathi", token_budget=512, progress=False)

    a, b = once(), once()
    assert a["summary"]["finished"] == 150
    assert a["requests"] == b["requests"] and a["summary"] == b["summary"]


def test_capacity_search_finds_the_known_capacity_of_a_synthetic_model(tmp_path):
    """Every iteration 10 ms, 2 running requests at most, 1-token prompts and 5-token outputs: a
    request holds a slot for 5 iterations, so the deployment serves 2 / (5 x 10 ms) = 40 QPS;
    above that the queue (and the scheduling delay) grows without bound. A finite run of D = 60 s
    passes up to ~4 / D above it (the median request then waits <= 2 s): the bound allows 10%."""
    target = simulated_target(constant_cost(0.010), sched_config=SchedulerConfig(max_num_seqs=2))
    w = Workload(fixed_trace(tmp_path, 1, 5), 0, drain_s=5, duration_s=60)
    res = capacity(target, w, tbt_slo_s=1.0, policy="sarathi", token_budget=512, qps_start=10,
                   resolution=0.03, progress=False)
    assert 0.95 * 40 <= res["capacity_qps"] <= 1.1 * 40, res["probes"]


def _batch(bid: int, n: int) -> Batch:
    return Batch(bid, [SeqChunk(f"r{bid}", [1] * n, 0, [0], True, SamplingParams(), 0)])


def test_pipeline_bubbles_are_the_stage_waits_for_an_earlier_stage():
    """Two stages; stage time = tokens x 1 s on stage 0, 1 s on stage 1. A (1 token): stage 0
    0-1, stage 1 1-2. B (3 tokens), submitted with A: stage 0 1-4, stage 1 4-5, idle 2-4 while B
    was in the pipeline: 2 s of bubble over 6 s busy."""
    class TwoStages:
        def stage_times(self, batch):
            return [float(batch.num_tokens), 1.0]

    clock = SimClock()
    w = SimulatedWorker(TwoStages(), clock, block_size=16, vocab_size=100)
    w.submit(_batch(0, 1))
    w.submit(_batch(1, 3))
    assert w.collect()[0].batch_id == 0 and clock.now == 2.0
    assert w.collect()[0].batch_id == 1 and clock.now == 5.0
    assert w.busy == [4.0, 2.0] and w.bubble == [0.0, 2.0]


def test_replicas_share_the_load_and_serve_what_one_cannot(tmp_path):
    target1 = simulated_target(constant_cost(0.010), sched_config=SchedulerConfig(max_num_seqs=4))
    target2 = simulated_target(constant_cost(0.010), replicas=2, sched_config=SchedulerConfig(max_num_seqs=4))
    w = Workload(fixed_trace(tmp_path, 1, 10), 0, drain_s=5, duration_s=20)
    one = run_once(target1, w, 60.0, progress=False, keep_requests=False)["summary"]
    two = run_once(target2, w, 60.0, progress=False, keep_requests=False)["summary"]
    assert sum(two["replica_requests"]) == two["requests"] == 1200
    assert min(two["replica_requests"]) >= 0.45 * 1200
    assert two["sched_delay_p50_s"] < 0.1 < 2.0 < one["sched_delay_p50_s"]


def _shift_run(tmp_path, token_budget: int, adaptive_slo: float) -> dict:
    """Prompts of 256 tokens, then (second half) 16x as long; iteration time grows with the prefill
    chunks' attention pairs, so a chunk of a long prompt's tail costs much more than the same
    chunk of a short prompt."""
    cost = CostModel([0.004, 2e-5, 0, 0.001, 0.02, 0], knee=16)   # s, s/token, s/kKV, s/M pairs
    cfg = SchedulerConfig(adaptive_tbt_slo_s=adaptive_slo, max_num_batched_tokens=2048)
    target = simulated_target(cost, sched_config=cfg, windows=6)
    w = Workload(fixed_trace(tmp_path, 256, 64), 300, drain_s=20, seed=1, shift_prompt_scale=16)
    return run_once(target, w, 1.0, policy="sarathi", token_budget=token_budget, progress=False,
                    keep_requests=False)["summary"]


def test_adaptive_budget_keeps_the_slo_in_every_window_across_a_prompt_length_step(tmp_path):
    slo = 0.05
    fixed = _shift_run(tmp_path, 1024, 0.0)
    adaptive = _shift_run(tmp_path, 1024, slo)
    assert fixed["finished"] == adaptive["finished"] == 300
    # the fixed budget that suits short prompts breaks the SLO once prompts grow ...
    assert max(w["tbt_p99_s"] for w in fixed["windows"]) > slo
    # ... the adaptive one holds it in every window, and shrinks tau after the step
    assert all(w["tbt_p99_s"] <= slo for w in adaptive["windows"]), adaptive["windows"]
    taus = [tau for _, tau in adaptive["tau_history"]]
    assert min(taus) < max(taus) and all(tau % 32 == 0 for tau in taus)


def test_simulate_command_writes_capacity_json_and_png(tmp_path):
    out = tmp_path / "cap"
    rc = main(["simulate", "--model", "llama-3-8b", "--device", "h100", "--capacity", "--tbt-slo", "0.1",
               "--num-requests", "30", "--qps-start", "4", "--resolution", "0.25", "--drain", "20",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["capacity_qps"] > 0 and res["simulated"]["device"]["name"] == "h100"
    assert res["probes"] and out.with_suffix(".png").is_file()


def test_simulate_refuses_adaptive_without_an_slo(capsys):
    assert main(["simulate", "--token-budget", "adaptive", "--num-requests", "5", "--no-progress"]) == 2
    assert "--tbt-slo" in capsys.readouterr().err


@pytest.mark.parametrize("routing", ["prefix", "mix", "mix-lowq", "mix-fc", "kv-cost", "cache-aware"])
def test_simulate_refuses_a_cache_aware_routing_without_prefix_caching(routing, capsys):
    assert main(["simulate", "--model", "llama-3-8b", "--device", "a100", "--replicas", "2", "--routing", routing,
                 "--num-requests", "5", "--no-progress"]) == 2
    assert "--prefix-caching" in capsys.readouterr().err


def test_simulate_runs_replicas_in_front_of_a_shared_kv_tier(tmp_path):
    out = tmp_path / "tier"
    assert main(["simulate", "--replicas", "2", "--routing", "shared-queue", "--prefix-caching", "--workload", "chat",
                 "--kv-tier-blocks", "100000", "--kv-tier-overlap", "--qps", "4", "--duration", "10",
                 "--out", str(out), "--no-progress"]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["simulated"]["kv_tier"] == {"blocks": 100000, "overlap": True, "kv_bytes_per_token": 131072,
                                           "link_gbs": 25.0}
    (run,) = res["runs"]
    assert run["summary"]["kv_tier_loaded_blocks"] > 0 and run["summary"]["kv_tier_load_s"] > 0


@pytest.mark.parametrize("args, says", [
    (["--replicas", "2", "--kv-tier-blocks", "1000"], "--prefix-caching"),
    (["--replicas", "2", "--prefix-caching", "--kv-tier-blocks", "-1"], ">= 0"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--prefix-caching", "--kv-tier-blocks", "1000"],
     "not pools")])
def test_simulate_refuses_a_kv_tier_it_cannot_model(args, says, capsys):
    assert main(["simulate", "--num-requests", "5", "--no-progress", *args]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_parallel_runs_keep_pp_batches_in_flight(pp, tmp_path):
    model = GPUCostModel("llama-2-70b", "a100", tp=4, pp=pp)
    target = simulated_target(model, depth=pp, num_blocks=model.kv_blocks(16))
    w = Workload(load_trace(max_total_len=8192), 60, drain_s=60)
    s = run_once(target, w, 1.0, policy="vllm", progress=False, keep_requests=False)["summary"]
    assert s["finished"] == 60 and 0 < s["pp_bubble_fraction"] <= s["pp_idle_fraction"] < 1
    assert len(s["stage_busy_s"][0]) == pp


def test_a_single_stage_is_never_idle_while_it_has_work(tmp_path):
    target = simulated_target(constant_cost(0.010), sched_config=SchedulerConfig(max_num_seqs=4))
    w = Workload(fixed_trace(tmp_path, 1, 10), 50, drain_s=5)
    s = run_once(target, w, 5.0, progress=False, keep_requests=False)["summary"]
    assert s["pp_idle_fraction"] == pytest.approx(0.0, abs=1e-9) and s["pp_bubble_fraction"] == 0.0


def test_plan_against_a_simulated_device_fits_the_models_strict_slo(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--device", "a100", "--model", "llama-3-8b", "--slo", "strict", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["token_budget"] % 32 == 0 and plan["token_budget"] >= 256
    assert plan["iteration_s"] <= plan["tbt_slo_s"] and plan["simulated"]["device"]["name"] == "a100"


def test_async_scheduling_hides_the_host_term_behind_the_device_in_simulation(tmp_path):
    """The GPU cost model's host term (scheduling, input preparation: cpu_fixed_s + cpu_per_seq_s
    a sequence) is serialized with each iteration's device time without async scheduling and
    runs beside the batch before with it: 16 decodes at a time, the median time between tokens
    falls by that term, and only by it; the same requests finish."""
    model = GPUCostModel("llama-3-8b", "h100")
    w = Workload(fixed_trace(tmp_path, 64, 200), 16, drain_s=30, seed=1)
    got = {}
    for asy in (False, True):
        target = simulated_target(model, num_blocks=model.kv_blocks(16),
                                  sched_config=SchedulerConfig(async_scheduling=asy))
        got[asy] = run_once(target, w, 1000.0, policy="sarathi", token_budget=512, progress=False)["summary"]
    assert got[True]["finished"] == got[False]["finished"] == 16
    host = model.cpu_fixed_s + 16 * model.cpu_per_seq_s
    saved = got[False]["tbt_p50_s"] - got[True]["tbt_p50_s"]
    assert saved == pytest.approx(host, rel=0.05)
    # a cost without a separate host term (a CPU profile's) is not changed by it
    for asy in (False, True):
        target = simulated_target(constant_cost(0.010), sched_config=SchedulerConfig(async_scheduling=asy))
        got[asy] = run_once(target, w, 1000.0, policy="sarathi", token_budget=512, progress=False)["summary"]
    assert got[True]["tbt_p50_s"] == pytest.approx(got[False]["tbt_p50_s"])
