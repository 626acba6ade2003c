"""Speculative decoding in the simulator (`sarathi simulate --speculative ... --spec-acceptance A`):
the real scheduler against a simulated A100 on a virtual clock, acceptance as a parameter. At low
load drafts cut the time between tokens; at saturation the batches are those without
speculation, so capacity holds."""
from __future__ import annotations

import json

from sarathi.cli import main
from sarathi.measure.gpu_costmodel import GPUCostModel
from sarathi.measure.simulate import simulated_target
from sarathi.measure.tools import Workload, run_once
from sarathi.measure.trace import load_trace
from shared.config import SchedulerConfig

MODEL = GPUCostModel("llama-3-8b", "a100")


def run(qps: float, speculative: str, acceptance: float, n: int = 40) -> dict:
    cfg = SchedulerConfig(speculative=speculative, num_speculative_tokens=4)
    target = simulated_target(MODEL, num_blocks=MODEL.kv_blocks(16), sched_config=cfg,
                              spec_acceptance=acceptance)
    w = Workload(load_trace(max_total_len=4096), n, drain_s=60, seed=5)
    return run_once(target, w, qps, policy="sarathi", token_budget=512, progress=False)["summary"]


def test_low_load_tbt_drops_with_accepted_drafts():
    off = run(0.5, "off", 0.0)
    on = run(0.5, "ngram", 0.7)
    assert on["finished"] == off["finished"] == 40
    # each verification step emits 1 + ~1.6 tokens for slightly more time: tokens that arrive
    # together have no gap, and requests end sooner
    assert on["tbt_p50_s"] < 0.7 * off["tbt_p50_s"], (on, off)
    assert on["e2e_p50_s"] < 0.7 * off["e2e_p50_s"], (on, off)


def test_saturation_is_no_worse_even_when_no_draft_is_accepted():
    off = run(40.0, "off", 0.0, n=80)
    on = run(40.0, "ngram", 0.0, n=80)
    assert on["finished"] == off["finished"]
    assert on["output_tok_per_s"] >= 0.98 * off["output_tok_per_s"], (on, off)
    assert on["ttft_p50_s"] <= 1.02 * off["ttft_p50_s"], (on, off)


def test_simulate_command_records_the_speculation_parameters(tmp_path):
    out = tmp_path / "spec"
    assert main(["simulate", "--model", "llama-3-8b", "--device", "a100", "--qps", "1",
                 "--num-requests", "10", "--drain", "20", "--speculative", "ngram",
                 "--spec-acceptance", "0.5", "--out", str(out), "--no-progress"]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["simulated"]["speculative"] == "ngram" and res["simulated"]["spec_acceptance"] == 0.5
    assert main(["simulate", "--speculative", "ngram", "--spec-acceptance", "1.5",
                 "--num-requests", "5", "--no-progress"]) == 2
