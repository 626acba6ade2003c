"""Property tests over random arrivals, lengths and memory sizes, for every policy.

Each example drives the scheduler step by step against the SimExecutor (whose tokens depend
only on the sequence's context, read back through the block tables) and checks the
invariants after every step; the outputs are compared with a run that has ample memory.
"""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.policies import POLICIES
from scheduler_svc.request import RequestStatus
from scheduler_svc.sim_executor import sim_engine
from shared.sampling import SamplingParams

EOS = 7
VOCAB = 40   # small, so EOS is sampled now and then (random early stops)
MAX_PROMPT, MAX_OUT = 24, 12

request_st = st.tuples(
    st.integers(0, 12),                                               # arrival step
    st.lists(st.integers(1, 3), min_size=1, max_size=MAX_PROMPT),     # prompt: few distinct
    st.integers(1, MAX_OUT),                                          # max_tokens
    st.booleans(),                                                    # ignore_eos
    st.booleans())                                                    # starts with the shared prefix


@st.composite
def workload_st(draw):
    """Requests (arrival step, prompt, max_tokens, ignore_eos); many share a "system prompt"
    so that prefix-cache hits, including on partly computed prefixes, are common."""
    shared = draw(st.lists(st.integers(1, 3), min_size=1, max_size=16))
    reqs = draw(st.lists(request_st, min_size=1, max_size=10))
    return [(t, (shared + p if use_shared else p)[:MAX_PROMPT], m, ig)
            for t, p, m, ig, use_shared in reqs]


PROPERTY_SETTINGS = settings(max_examples=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


def engine(policy, **kw):
    return sim_engine(policy, vocab_size=VOCAB, eos_token_ids=(EOS,), max_model_len=64, **kw)


def drive(loop, workload, check=lambda loop, batch, before: None, max_steps=2000):
    """Add requests at their arrival steps and run to the end; returns the events by request."""
    events: dict[str, list] = {}
    pending = sorted(enumerate(workload), key=lambda x: x[1][0])
    step = 0
    while pending or loop.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, max_tokens, ignore_eos) = pending.pop(0)
            loop.add_request(f"r{i}", prompt, SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos))
        sched = loop.scheduler
        before = {r.req_id for r in sched.running if r.is_decode}
        batch = sched.schedule()
        if batch is not None:
            check(loop, batch, before)
            for ev in sched.update(batch, loop.executor.execute(batch)):
                events.setdefault(ev.req_id, []).append(ev)
        check_blocks(loop)
        step += 1
        assert step < max_steps, "no progress"
    return events


def check_blocks(loop):
    """free + used == total, and the used blocks are exactly those the running requests hold."""
    sched = loop.scheduler
    bm = sched.block_manager
    holders = Counter(b for r in sched.running for b in r.block_table)
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert bm.num_used_blocks == len(holders)
    assert all(bm.ref_counts[b] == n for b, n in holders.items())
    assert all(not r.block_table for r in sched.waiting)
    for r in sched.running:
        assert len(r.block_table) * bm.block_size >= r.num_computed_tokens


def outputs(events):
    return {rid: [e.token_id for e in evs if e.token_id is not None] for rid, evs in events.items()}


def reference_outputs(workload):
    return outputs(drive(engine("sarathi", token_budget=64, num_blocks=1024), workload))


memory_st = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4]),
    "max_num_seqs": st.integers(1, 6),
    "token_budget": st.integers(1, 40),
    "enable_prefix_caching": st.booleans(),
    "tile_size": st.sampled_from([0, 0, 4]),
})


def tight_blocks(block_size: int, extra: int) -> int:
    """Just enough blocks for the longest possible request, plus `extra`: forces preemption."""
    return -(-(MAX_PROMPT + MAX_OUT) // block_size) + extra


@pytest.mark.parametrize("policy", POLICIES)
@PROPERTY_SETTINGS
@given(workload=workload_st(), mem=memory_st, extra=st.integers(0, 12))
def test_every_request_finishes_exactly_once_with_contiguous_token_indices(policy, workload, mem, extra):
    loop = engine(policy, num_blocks=tight_blocks(mem["block_size"], extra), **mem)
    events = drive(loop, workload)
    assert set(events) == {f"r{i}" for i in range(len(workload))}
    for rid, evs in events.items():
        ends = [e for e in evs if e.finish_reason is not None]
        assert len(ends) == 1 and ends[0] is evs[-1], rid
        assert [e.index for e in evs] == list(range(len(evs)))
        assert ends[0].finish_reason in ("stop", "length")
    assert not loop.scheduler.running and not loop.scheduler.waiting


@pytest.mark.parametrize("policy", POLICIES)
@PROPERTY_SETTINGS
@given(workload=workload_st(), mem=memory_st, extra=st.integers(0, 4))
def test_preemption_loses_no_request_and_no_generated_token(policy, workload, mem, extra):
    loop = engine(policy, num_blocks=tight_blocks(mem["block_size"], extra), **mem)
    got = outputs(drive(loop, workload))
    assert got == reference_outputs(workload)
    for rid, toks in got.items():
        _, _, max_tokens, _ = workload[int(rid[1:])]
        assert len(toks) == max_tokens or toks[-1] == EOS


@PROPERTY_SETTINGS
@given(workload=workload_st(), mem=memory_st, extra=st.integers(0, 12))
def test_sarathi_never_exceeds_tau_and_never_stalls_a_decode_when_tau_suffices(workload, mem, extra):
    tau = mem["token_budget"]

    def check(loop, batch, decodes_before):
        assert batch.num_tokens <= tau
        in_batch = {s.req_id for s in batch.seqs}
        still_running = {r.req_id for r in loop.scheduler.running}
        if tau >= len(decodes_before):
            assert decodes_before & still_running <= in_batch

    loop = engine("sarathi", num_blocks=tight_blocks(mem["block_size"], extra), **mem)
    drive(loop, workload, check)


@PROPERTY_SETTINGS
@given(workload=workload_st(), block_size=st.sampled_from([1, 2, 4]))
def test_no_request_is_in_two_batches_in_flight(workload, block_size):
    """Pipelined use: schedule twice before updating; the two batches share no request."""
    loop = engine("sarathi", block_size=block_size, num_blocks=64, token_budget=16)
    for i, (_, prompt, max_tokens, _) in enumerate(workload):
        loop.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    sched = loop.scheduler
    for _ in range(500):
        if not sched.has_unfinished():
            break
        batches = [b for b in (sched.schedule(), sched.schedule()) if b is not None]
        if len(batches) == 2:
            assert not {s.req_id for s in batches[0].seqs} & {s.req_id for s in batches[1].seqs}
        for b in batches:
            sched.update(b, loop.executor.execute(b))
    assert not sched.has_unfinished()


def test_status_is_finished_only_after_the_end_event():
    loop = engine("sarathi", num_blocks=64)
    req = loop.add_request("x", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2,
                                                          ignore_eos=True))
    assert req.status is RequestStatus.WAITING
    loop.step()
    assert req.status is RequestStatus.RUNNING
    loop.run_until_done()
    assert req.status is RequestStatus.FINISHED and req.finish_reason == "length"
