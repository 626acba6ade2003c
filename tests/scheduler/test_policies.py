"""Policy details beyond Figure 7: budgets, caps, tile alignment, FCFS admission."""
from __future__ import annotations

import pytest

from scheduler_svc.policies import POLICIES, POLICY_CLASSES, make_policy
from scheduler_svc.sim_executor import sim_engine
from shared.config import SchedulerConfig
from shared.sampling import SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def first_batch(policy, prompts, **kw):
    loop = sim_engine(policy, block_size=4, num_blocks=256, max_model_len=256, **kw)
    for i, p in enumerate(prompts):
        loop.add_request(f"r{i}", p, SP)
    batch = loop.scheduler.schedule()
    return {s.req_id: len(s.token_ids) for s in batch.seqs}


def test_every_configured_policy_name_has_a_policy_class():
    assert set(POLICY_CLASSES) == set(POLICIES)
    for name in POLICIES:
        assert make_policy(SchedulerConfig(policy=name), 2048).name == name


def test_sarathi_cuts_the_last_prefill_to_the_budget_left():
    assert first_batch("sarathi", [[1] * 10, [2] * 10], token_budget=16) == {"r0": 10, "r1": 6}


def test_sarathi_tile_alignment_makes_the_batch_a_multiple_of_the_tile():
    batch = first_batch("sarathi", [[1] * 10, [2] * 30], token_budget=29, tile_size=8)
    assert batch == {"r0": 10, "r1": 14}   # 24 tokens: the 5 past the tile boundary wait


def test_sarathi_tile_alignment_never_cuts_a_chunk_that_finishes_its_prompt():
    batch = first_batch("sarathi", [[1] * 10, [2] * 3], token_budget=29, tile_size=8)
    assert batch == {"r0": 10, "r1": 3}


def test_max_num_seqs_caps_the_running_set_for_every_policy():
    for policy in POLICIES:
        batch = first_batch(policy, [[1] * 3] * 5, max_num_seqs=2)
        assert len(batch) == 2, policy


def test_admission_is_fcfs_a_head_that_does_not_fit_blocks_the_queue():
    loop = sim_engine("sarathi", block_size=4, num_blocks=10, max_model_len=64,
                      token_budget=64)
    loop.add_request("big", [1] * 24, SP)       # 6 blocks
    loop.add_request("bigger", [2] * 28, SP)    # 7 blocks: does not fit beside "big"
    loop.add_request("small", [3] * 2, SP)      # would fit, but must wait its turn
    batch = loop.scheduler.schedule()
    assert [s.req_id for s in batch.seqs] == ["big"]


def test_vllm_fills_a_prefill_batch_up_to_max_num_batched_tokens():
    batch = first_batch("vllm", [[1] * 10, [2] * 10, [3] * 10], max_num_batched_tokens=25)
    assert batch == {"r0": 10, "r1": 10}


def test_vllm_runs_a_prompt_longer_than_the_token_cap_alone_rather_than_never():
    batch = first_batch("vllm", [[1] * 40, [2] * 5], max_num_batched_tokens=16)
    assert batch == {"r0": 40}


def test_orca_is_bounded_by_memory_not_by_a_token_budget():
    batch = first_batch("orca", [[1] * 100, [2] * 100], token_budget=8,
                        max_num_batched_tokens=16)
    assert batch == {"r0": 100, "r1": 100}


def test_faster_transformer_admits_new_requests_only_into_an_empty_engine():
    loop = sim_engine("faster_transformer", block_size=4, num_blocks=64, max_model_len=64)
    loop.add_request("a", [1, 2], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    loop.step()
    loop.add_request("b", [3, 4], SP)
    seen = []
    while loop.has_unfinished():
        batch = loop.scheduler.schedule()
        seen.append(sorted(s.req_id for s in batch.seqs))
        loop.scheduler.update(batch, loop.executor.execute(batch))
    assert seen[:3] == [["a"], ["a"], ["b"]]


def test_chunked_only_never_mixes_prefill_chunks_and_decodes():
    loop = sim_engine("chunked_only", token_budget=6, block_size=4, num_blocks=64,
                      max_model_len=64)
    for i in range(4):
        loop.add_request(f"r{i}", [i + 1] * (5 + 3 * i), SP)
    while loop.has_unfinished():
        batch = loop.scheduler.schedule()
        kinds = {s.output_index > 0 and len(s.token_ids) == 1 for s in batch.seqs}
        assert len(kinds) == 1
        loop.scheduler.update(batch, loop.executor.execute(batch))


def test_an_unknown_policy_is_refused():
    """The names live with the classes (scheduler_svc.policies), so the config cannot check them:
    the Scheduler refuses the name when it is built, before any batch."""
    with pytest.raises(ValueError, match="unknown policy 'round_robin'; choose one of sarathi, vllm"):
        sim_engine("round_robin")
