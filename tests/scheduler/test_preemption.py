"""Preemption by recompute: the newest running request gives its blocks back and later
re-prefills its whole sequence, generated tokens included."""
from __future__ import annotations

from scheduler_svc.request import RequestStatus
from scheduler_svc.sim_executor import sim_engine
from shared.sampling import SamplingParams


def sp(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def tight_engine(policy="sarathi"):
    """Two 4-token prompts that each grow to 16 tokens, in 6 blocks of 4 (one request fits)."""
    loop = sim_engine(policy, block_size=4, num_blocks=6, max_model_len=32, token_budget=32)
    old = loop.add_request("old", [1, 2, 3, 4], sp(12))
    new = loop.add_request("new", [5, 6, 7, 8], sp(12))
    return loop, old, new


def step_until_preempted(loop):
    while loop.scheduler.stats()["num_preemptions"] == 0:
        loop.step()


def test_the_newest_running_request_is_the_victim():
    loop, old, new = tight_engine()
    step_until_preempted(loop)
    assert new.status is RequestStatus.PREEMPTED and old.status is RequestStatus.RUNNING


def test_the_victim_goes_back_to_the_head_of_the_waiting_queue_without_blocks():
    loop, old, new = tight_engine()
    loop.add_request("later", [9], sp(1))
    step_until_preempted(loop)
    assert loop.scheduler.waiting[0] is new
    assert new.block_table == [] and new.num_computed_tokens == 0


def test_the_victim_keeps_its_generated_tokens_and_recomputes_them():
    loop, old, new = tight_engine()
    step_until_preempted(loop)
    kept = new.output_token_ids
    assert kept                                   # it had generated tokens
    loop.run_until_done()
    assert new.output_token_ids[:len(kept)] == kept
    assert len(new.output_token_ids) == 12 and new.num_preemptions >= 1


def test_preempted_outputs_equal_those_of_a_run_with_ample_memory():
    loop, old, new = tight_engine()
    loop.run_until_done()
    ample = sim_engine("sarathi", block_size=4, num_blocks=64, max_model_len=32)
    o2 = ample.add_request("old", [1, 2, 3, 4], sp(12))
    n2 = ample.add_request("new", [5, 6, 7, 8], sp(12))
    ample.run_until_done()
    assert (old.output_token_ids, new.output_token_ids) == (o2.output_token_ids,
                                                            n2.output_token_ids)


def test_a_preempted_request_is_announced_in_the_batch_that_preempted_it():
    loop, old, new = tight_engine()
    sched = loop.scheduler
    while True:
        batch = sched.schedule()
        if sched.stats()["num_preemptions"]:
            break
        sched.update(batch, loop.executor.execute(batch))
    assert batch.freed_req_ids == ["new"]   # the worker drops its state before this batch runs
    assert "new" not in {s.req_id for s in batch.seqs}


def test_preemption_works_under_every_policy():
    for policy in ("sarathi", "vllm", "orca", "faster_transformer", "hybrid_only",
                   "chunked_only"):
        loop, old, new = tight_engine(policy)
        loop.run_until_done()
        assert len(old.output_token_ids) == len(new.output_token_ids) == 12, policy
