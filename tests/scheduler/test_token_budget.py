"""The adaptive token budget (scheduler_svc/token_budget.py) on synthetic iteration times
t = a + b x T, and wired into the real Scheduler: the sarathi policy's tau follows it."""
from __future__ import annotations

import pytest

from scheduler_svc.sim_executor import SimClock, sim_engine
from scheduler_svc.token_budget import AdaptiveTokenBudget
from shared.config import SchedulerConfig


def run_full_batches(ctl: AdaptiveTokenBudget, a: float, b: float, steps: int) -> None:
    for _ in range(steps):
        ctl.observe(ctl.tau, a + b * ctl.tau)


def test_tau_converges_to_the_largest_tile_whose_iteration_meets_the_target():
    ctl = AdaptiveTokenBudget(0.1, tile=32, initial=512, max_tau=8192)
    a, b = 0.02, 5e-5            # target 0.085 s -> (0.085 - 0.02) / 5e-5 = 1300 tokens
    run_full_batches(ctl, a, b, 200)
    assert ctl.tau % 32 == 0
    assert a + b * ctl.tau <= ctl.target_s < a + b * (ctl.tau + 64)


def test_a_step_up_in_per_token_cost_cuts_tau_at_once_and_a_step_down_lets_it_grow_back():
    ctl = AdaptiveTokenBudget(0.1, tile=32, initial=512, window=16)
    run_full_batches(ctl, 0.02, 5e-5, 100)
    before = ctl.tau
    ctl.observe(ctl.tau, 0.02 + 2e-4 * ctl.tau)      # the first expensive batch already cuts it
    assert ctl.tau < before
    run_full_batches(ctl, 0.02, 2e-4, 20)
    assert 0.02 + 2e-4 * ctl.tau <= ctl.target_s
    run_full_batches(ctl, 0.02, 5e-5, 100)           # and grows back, a window at a time
    assert ctl.tau == before


def test_tau_stays_tile_aligned_within_bounds():
    ctl = AdaptiveTokenBudget(0.05, tile=64, initial=1000, max_tau=2000)
    assert ctl.tau == 960 and ctl.max_tau == 1984
    run_full_batches(ctl, 0.0, 1e-7, 50)             # nearly free: capped
    assert ctl.tau == 1984
    run_full_batches(ctl, 1.0, 1e-3, 50)             # hopeless: one tile
    assert ctl.tau == 64


def test_a_part_full_batch_changes_tau_only_when_it_was_too_slow():
    ctl = AdaptiveTokenBudget(0.1, tile=32, initial=1024)
    ctl.observe(100, 0.05)
    assert ctl.tau == 1024
    ctl.observe(200, 0.17)                           # 200 tokens took 2x the target
    assert ctl.tau == 96


def test_the_scheduler_feeds_batch_times_to_the_adaptive_sarathi_policy():
    """A simulated engine whose iterations cost 1 ms per token: under a 100 ms SLO tau settles at
    the largest tile <= 85 tokens (headroom 0.85), from a start of 512."""
    engine = sim_engine("sarathi", token_budget=512, clock=SimClock(), verify_kv=False,
                        adaptive_tbt_slo_s=0.1, cost_model=lambda batch: 1e-3 * batch.num_tokens)
    policy = engine.scheduler.policy
    for i in range(4):
        engine.add_request(f"r{i}", list(range(1, 1500)))
    seen = {policy.token_budget()}
    while engine.has_unfinished():
        engine.step()
        seen.add(policy.token_budget())
    assert policy.token_budget() == 64 and 512 in seen


def test_fixed_budget_policies_ignore_batch_times():
    engine = sim_engine("sarathi", token_budget=256, verify_kv=False, cost_model=lambda b: 10.0)
    engine.generate([list(range(1, 600))])
    assert engine.scheduler.policy.adaptive is None and engine.scheduler.policy.token_budget() == 256


def test_an_adaptive_budget_needs_a_positive_slo():
    with pytest.raises(ValueError):
        AdaptiveTokenBudget(0.0)
    with pytest.raises(ValueError):
        SchedulerConfig(adaptive_tbt_slo_s=-1.0)
