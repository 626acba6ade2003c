"""Speculative decoding on the scheduler's side, against the simulated worker: the proposers,
exactness (the sim worker judges drafts like a greedy model), the rollback of rejected drafts'
blocks, and the budget rule (drafts only from leftover budget, none at saturation)."""
from __future__ import annotations

import random

import pytest

from scheduler_svc.request import Request
from scheduler_svc.sim_executor import linear_cost_model, sim_engine
from scheduler_svc.speculative import NgramProposer, Speculator, check_speculative, eligible
from scheduler_svc.speculative.suffix import SuffixProposer
from shared.sampling import SamplingParams

PERIOD = [11, 12, 13, 14, 15, 16, 17]


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def req(tokens, prompt_len=None, **kw):
    r = Request("r", list(tokens[:prompt_len or len(tokens)]), greedy(64, **kw), 0.0)
    r.token_ids = list(tokens)
    return r


# -- proposers ---------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_suffix():
    p = NgramProposer(min_n=2, max_n=3)
    r = req([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3])
    assert p.propose(r, 3) == [7, 8, 2]          # the latest "2 3" is followed by 7 8
    r.token_ids.append(4)                        # "2 3 4": only the first occurrence has it
    assert p.propose(r, 2) == [5, 9]
    r.token_ids += [6, 6]                        # no 2- or 3-gram occurred before
    assert p.propose(r, 4) == []


def test_ngram_index_is_incremental_and_matches_a_full_scan():
    rng = random.Random(1)
    p = NgramProposer(min_n=1, max_n=3)
    toks = [rng.randrange(6) for _ in range(20)]
    r = req(toks)
    for _ in range(80):
        got = p.propose(r, 4)
        want = []
        for n in range(3, 0, -1):     # reference: scan for the latest earlier occurrence
            suffix = r.token_ids[-n:]
            hits = [j for j in range(len(r.token_ids) - n) if r.token_ids[j:j + n] == suffix]
            if hits:
                want = r.token_ids[hits[-1] + n:hits[-1] + n + 4]
                break
        assert got == want
        r.token_ids.append(rng.randrange(6))


def test_suffix_proposer_finds_continuations_in_finished_outputs():
    p = SuffixProposer(min_n=2, max_n=4)
    done = Request("a", [1], greedy(8), 0.0)
    done.token_ids = [1, 40, 41, 42, 43, 44]
    p.finish(done)
    r = req([7, 8, 40, 41])
    assert p.propose(r, 3) == [42, 43, 44]
    r2 = req([40, 41, 50, 40, 41])                # its own tokens win a tie
    assert p.propose(r2, 2) == [50, 40]


def test_k_follows_acceptance_and_is_capped_by_max_tokens():
    spec = Speculator(NgramProposer(), max_k=8)
    r = req(PERIOD * 3, prompt_len=5)
    k0 = spec.k_for(r)
    assert 1 <= k0 < 8                            # the prior: alpha = 0.5
    for _ in range(10):
        spec.observe(r, 4, 4)
    assert spec.k_for(r) == 8
    for _ in range(20):
        spec.observe(r, 4, 0)
    assert spec.k_for(r) == 0
    for _ in range(400):                         # decodes without drafts: it is tried again
        spec.no_draft(r)
    assert spec.k_for(r) >= 1
    r.sampling = greedy(len(r.output_token_ids) + 3)
    assert spec.k_for(r) <= 2                    # 3 tokens left: 2 drafts and the one after


def test_eligibility_and_start_checks():
    assert eligible(req([1, 2]))
    assert not eligible(req([1, 2], speculative=False))
    assert not eligible(req([1, 2], repetition_penalty=1.2))
    r = Request("s", [1], SamplingParams(temperature=0.8, seed=3), 0.0)
    assert not eligible(r)                       # seeded sampling: tokens must not depend on k
    assert eligible(Request("u", [1], SamplingParams(temperature=0.8), 0.0))
    with pytest.raises(ValueError, match="num-speculative-tokens"):
        check_speculative("ngram", 0)
    with pytest.raises(ValueError, match="num-speculative-tokens"):
        check_speculative("ngram", 99)
    with pytest.raises(ValueError, match="unknown speculative method"):
        check_speculative("medusa", 4)
    check_speculative("off", 0)


# -- the scheduler with the simulated worker ----------------------------------------------------
def run(speculative, prompts, n=40, scripts=None, check=None, **kw):
    loop = sim_engine(speculative=speculative, block_size=4, num_blocks=256, max_model_len=512,
                      scripts=scripts or {}, **kw)
    reqs = [loop.add_request(f"r{i}", p, greedy(n)) for i, p in enumerate(prompts)]
    while loop.has_unfinished():
        loop.step()
        if check is not None:
            check(loop)
    return loop, [r.output_token_ids for r in reqs]


def test_greedy_outputs_equal_speculation_off_and_drafts_are_accepted():
    # scripted outputs repeat the prompt's period: n-gram drafts are right most of the time;
    # past the script the sim's tokens are hashes, so drafts are also rejected (rollback)
    prompts = [PERIOD * 3, [5, 6, 7, 8] * 4, [21, 22, 23] * 5]
    scripts = {f"r{i}": (p * 4)[:24] for i, p in enumerate(prompts)}
    _, off = run("off", prompts, scripts=scripts)
    loop, on = run("ngram", prompts, scripts=scripts)
    assert on == off
    st = loop.scheduler.stats()
    assert st["spec_accepted_tokens"] > 20 and st["spec_proposed_tokens"] > st["spec_accepted_tokens"]
    assert st["spec_tokens_per_step"] > 1.5
    assert st["num_free_blocks"] == 256           # every block came back


def invariants(loop):
    bm, sched = loop.scheduler.block_manager, loop.scheduler
    for r in sched.running:
        assert r.num_computed_tokens <= r.num_tokens
        if not r.in_flight:
            assert not r.draft_token_ids
            # rollback: no block beyond what the request's tokens (and the next slot) need
            assert len(r.block_table) <= bm.blocks_for(r.num_tokens + 1)
    used = sum(len(r.block_table) for r in sched.running)
    assert bm.num_free_blocks + used == bm.num_blocks


def test_rejected_drafts_roll_back_blocks_and_context():
    # every draft rejected: the output is still the same, and blocks never leak
    prompts = [PERIOD * 3, [5, 6, 7, 8] * 4]
    scripts = {f"r{i}": (p * 4)[:30] for i, p in enumerate(prompts)}
    _, off = run("off", prompts, scripts=scripts)
    loop, on = run("ngram", prompts, scripts=scripts, check=invariants, spec_acceptance=0.0)
    assert on == off
    st = loop.scheduler.stats()
    assert st["spec_proposed_tokens"] > 0 and st["spec_accepted_tokens"] == 0


def test_a_stop_inside_the_accepted_drafts_ends_the_request_there():
    prompt = PERIOD * 3
    loop = sim_engine(speculative="ngram", block_size=4, num_blocks=64, max_model_len=256,
                      scripts={"r": PERIOD * 4})
    r = loop.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[15]))
    loop.run_until_done()
    assert r.output_token_ids == [11, 12, 13, 14, 15] and r.finish_reason == "stop"
    r2 = loop.add_request("r2", prompt, greedy(9))
    loop.executor.scripts["r2"] = PERIOD * 4
    loop.run_until_done()
    assert r2.output_token_ids == (PERIOD * 2)[:9] and r2.finish_reason == "length"
    assert loop.scheduler.block_manager.num_free_blocks == 64


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca"])
def test_at_saturation_no_batch_has_drafts_and_at_low_load_they_are_scheduled(policy):
    loop = sim_engine(policy, speculative="ngram", block_size=4, num_blocks=512, max_model_len=512,
                      token_budget=64, max_num_batched_tokens=64, max_num_seqs=4, spec_acceptance=1.0,
                      scripts={f"r{i}": PERIOD * 6 for i in range(12)})
    for i in range(12):
        loop.add_request(f"r{i}", PERIOD * 8, greedy(24))
    sched, seen = loop.scheduler, []
    schedule = sched.schedule

    def spy():
        batch = schedule()
        if batch is not None:
            cut = any(s.sample is False for s in batch.seqs)   # a prompt chunk left tokens over
            seen.append((bool(sched.waiting) or cut, sum(s.num_draft_tokens for s in batch.seqs)))
        return batch
    sched.schedule = spy
    loop.run_until_done()
    assert sum(d for busy, d in seen if busy) == 0
    assert any(busy for busy, _ in seen)
    assert sum(d for busy, d in seen if not busy) > 0


def test_drafts_use_only_the_budget_left_and_share_it():
    loop = sim_engine(speculative="ngram", num_speculative_tokens=8, block_size=4,
                      num_blocks=512, max_model_len=512, token_budget=10, spec_acceptance=1.0,
                      scripts={f"r{i}": PERIOD * 6 for i in range(4)})
    reqs = [loop.add_request(f"r{i}", PERIOD * 4, greedy(30)) for i in range(4)]
    for r in reqs:
        r.spec_state["_acceptance"] = [50.0, 1.0]      # high acceptance: each wants 8 drafts
    while any(r.num_output_tokens == 0 for r in reqs):
        loop.step()
    batch = loop.scheduler.schedule()
    assert batch.num_tokens <= 10
    drafts = sorted(s.num_draft_tokens for s in batch.seqs)
    assert sum(drafts) == 10 - 4 and drafts[-1] - drafts[0] <= 1   # 6 drafts shared 2, 2, 1, 1


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca"])
def test_capacity_at_saturation_is_never_below_speculation_off(policy):
    """The same saturating Poisson load, worst case for speculation (no draft is ever
    accepted): the workload takes no longer to finish than without it, within 2%."""
    def makespan(speculative):
        loop = sim_engine(policy, speculative=speculative, block_size=16, num_blocks=2048,
                          max_model_len=2048, token_budget=256, max_num_seqs=32, verify_kv=False,
                          cost_model=linear_cost_model(), spec_acceptance=0.0)
        rng = random.Random(7)
        t, pending = 0.0, []
        for i in range(120):
            t += rng.expovariate(40.0)                 # 40 QPS: far beyond capacity
            prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(64, 400))]
            pending.append((t, f"r{i}", prompt, rng.randrange(16, 96)))
        clock = loop.scheduler.clock
        while pending or loop.has_unfinished():
            while pending and pending[0][0] <= clock.now:
                at, rid, prompt, n = pending.pop(0)
                loop.add_request(rid, prompt, greedy(n), arrival_time=at)
            if loop.has_unfinished():
                loop.step()
            else:
                clock.now = pending[0][0]
        return clock.now, loop.scheduler.stats()
    off, _ = makespan("off")
    on, st = makespan("ngram")
    assert st["spec_proposed_tokens"] > 0          # drafts ran (at the light tail of the load)
    assert on <= off * 1.02


def test_prometheus_metrics_report_drafts_and_acceptance():
    from prometheus_client import CollectorRegistry

    from scheduler_svc.metrics import SchedulerMetrics
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry)
    loop = sim_engine(speculative="ngram", block_size=4, num_blocks=128, max_model_len=256,
                      scripts={"r": PERIOD * 5})
    loop.on_batch = lambda batch, out, s: metrics.observe_batch(batch, s)
    loop.add_request("r", PERIOD * 3, greedy(30))
    while loop.has_unfinished():
        loop.step()
        metrics.observe_stats(loop.scheduler.stats())
    st = loop.scheduler.stats()
    value = registry.get_sample_value
    assert value("sarathi_scheduler_spec_draft_tokens_total") == st["spec_proposed_tokens"] > 0
    assert value("sarathi_scheduler_spec_accepted_tokens_total") == st["spec_accepted_tokens"] > 0
    assert value("sarathi_scheduler_spec_acceptance_ratio") == pytest.approx(st["spec_acceptance_rate"])
    assert value("sarathi_scheduler_spec_tokens_per_step") > 1.0
    assert value("sarathi_scheduler_tokens_total", {"kind": "draft"}) == st["spec_proposed_tokens"]


def test_k_weighs_acceptance_against_the_measured_cost_of_a_draft():
    spec = Speculator(NgramProposer(), max_k=8)
    r = req(PERIOD * 3, prompt_len=5)
    r.spec_state["_acceptance"] = [9.0, 1.0]            # alpha = 0.9
    r.spec_state["_idle"] = 0                           # as after a verification step: no probe
    assert not spec.needs_baseline(1)                    # nothing timed yet: no probe batches
    spec.observe_batch(1, 0, 0, 0.010)                  # a decode alone: 10 ms
    assert spec.needs_baseline(2)                        # 2 decodes were never timed alone
    spec.observe_batch(1, 4, 0, 0.014)                  # 4 drafts added 4 ms: c = 0.1
    assert spec.draft_cost == pytest.approx(0.1)
    cheap = spec.k_for(r, 1)
    assert cheap >= 6
    assert spec.k_for(r, 8) < cheap                      # the cost is every decode's: fewer drafts
    assert spec.k_for(r, 40) == 0
    r.spec_state["_acceptance"] = [1.0, 4.0]            # alpha = 0.2: 1.2 tokens for 1.1 steps
    assert spec.k_for(r, 1) == 1
    spec.cost = 0.3                                     # ... not for 1.3
    assert spec.k_for(r, 1) == 0
    spec.observe_batch(1, 0, 300, 0.5)                  # a batch with a prefill says nothing
    assert spec.draft_cost == 0.3


def test_suffix_drafts_from_an_earlier_answer_are_accepted_where_ngram_has_none():
    # the answer is not in the prompt: prompt lookup finds nothing, the suffix proposer finds
    # the earlier request's answer
    answer = [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42] * 2
    got = {}
    for method in ("ngram", "suffix"):
        loop = sim_engine(speculative=method, block_size=4, num_blocks=128, max_model_len=256,
                          scripts={"first": answer, "second": answer})
        loop.add_request("first", [7, 8, 9, 10], greedy(24))
        loop.run_until_done()
        before = loop.scheduler.stats()["spec_accepted_tokens"]
        second = loop.add_request("second", [5, 6, 9, 10], greedy(24))
        loop.run_until_done()
        assert second.output_token_ids == answer
        got[method] = loop.scheduler.stats()["spec_accepted_tokens"] - before
    assert got["suffix"] > got["ngram"] and got["suffix"] >= 10


def test_a_request_without_evidence_gets_a_probe_where_drafts_cost_more_than_the_prior_pays():
    # c = 0.6: with the prior alpha = 0.5, one draft yields 1.5 tokens for 1.6 steps, so the rule
    # alone says 0 for every request that never drafted, and it would never learn otherwise
    spec = Speculator(NgramProposer(), max_k=8, probe_every=10)
    spec.cost = 0.6
    fresh = req(PERIOD * 3, prompt_len=5)
    assert spec.k_for(fresh) == 1                        # a probe
    spec.observe(fresh, 1, 0)                            # rejected
    assert spec.k_for(fresh) == 0
    for _ in range(9):
        spec.no_draft(fresh)
    assert spec.k_for(fresh) == 0
    spec.no_draft(fresh)                                 # probe_every decodes without drafts
    assert spec.k_for(fresh) == 1
    copying = req(PERIOD * 3, prompt_len=5)
    for _ in range(3):
        assert spec.k_for(copying) >= 1
        spec.observe(copying, spec.k_for(copying), spec.k_for(copying))   # all accepted
    assert spec.k_for(copying) >= 2                      # the evidence pays for more drafts


def test_drafts_still_start_after_the_measured_cost_of_a_draft_turns_out_high():
    # a draft token costs 0.012 s on a 0.022 s step of one decode: c = 0.55 once measured. The
    # requests run one after another, each copying its prompt (drafts would be accepted): the
    # later ones, which start after c is known, must still speculate.
    period = [51, 52, 53, 54, 55, 56, 57, 58, 59]
    loop = sim_engine(speculative="ngram", block_size=4, num_blocks=256, max_model_len=512,
                      cost_model=linear_cost_model(0.010, 0.012, 0.012),
                      scripts={f"r{i}": period * 8 for i in range(6)})
    accepted = []
    for i in range(6):
        before = loop.scheduler.stats()["spec_accepted_tokens"]
        r = loop.add_request(f"r{i}", period * 3, greedy(48))
        loop.run_until_done()
        assert r.output_token_ids == (period * 8)[:48]
        accepted.append(loop.scheduler.stats()["spec_accepted_tokens"] - before)
    assert loop.scheduler.stats()["spec_draft_cost"] > 0.5
    assert all(a >= 10 for a in accepted[3:]), accepted


def test_the_time_a_proposer_takes_counts_in_the_cost_of_a_draft():
    # a draft model proposes while the batch is planned: here its drafts cost the worker nothing
    # (c = 0 there) but take 4 ms a token to propose, on 10 ms steps: c = 0.4, not 0
    period = [51, 52, 53, 54, 55, 56, 57, 58, 59]
    loop = sim_engine(speculative="ngram", block_size=4, num_blocks=256, max_model_len=512,
                      cost_model=linear_cost_model(0.010, 0.0, 0.0),
                      scripts={f"r{i}": period * 8 for i in range(3)})
    clock, spec = loop.scheduler.clock, loop.scheduler.speculator
    inner = spec.proposer

    class SlowProposer:
        name = inner.name

        def propose(self, req, k):
            drafts = inner.propose(req, k)
            clock.now += 0.004 * len(drafts)
            return drafts

    spec.proposer = SlowProposer()
    for i in range(3):
        r = loop.add_request(f"r{i}", period * 3, greedy(48))
        loop.run_until_done()
        assert r.output_token_ids == (period * 8)[:48]
    assert loop.scheduler.stats()["spec_proposed_tokens"] > 0
    assert loop.scheduler.stats()["spec_draft_cost"] == pytest.approx(0.4, abs=0.05)


def test_a_stalled_step_moves_neither_the_cost_of_a_draft_nor_its_baseline():
    # steps of one decode take 10 ms, 14 ms with 4 drafts: c = 0.1. A 0.5 s stall of a step with
    # one draft would read as c = 49, one of a step without drafts would make every draft look
    # free (c = 0) for a while: c is a median over recent steps, so neither moves it
    spec = Speculator(NgramProposer(), max_k=8)
    for _ in range(4):
        spec.observe_batch(1, 0, 0, 0.010)
        spec.observe_batch(1, 4, 0, 0.014)
    assert spec.draft_cost == pytest.approx(0.1)
    spec.observe_batch(1, 1, 0, 0.5)                     # a stalled step with a draft
    assert spec.draft_cost == pytest.approx(0.1)
    spec.observe_batch(1, 0, 0, 0.5)                     # a stalled step without
    spec.observe_batch(1, 4, 0, 0.014)
    assert spec.draft_cost == pytest.approx(0.1)
    r = req(PERIOD * 3, prompt_len=5)
    r.spec_state["_acceptance"] = [9.0, 1.0]             # alpha = 0.9
    r.spec_state["_idle"] = 0
    assert spec.k_for(r) >= 4                            # drafting goes on
    for _ in range(16):                                  # drafts that really cost more: c follows
        spec.observe_batch(1, 2, 0, 0.016)
    assert spec.draft_cost == pytest.approx(0.3)


def test_the_cost_of_a_draft_is_measured_per_batch_size():
    # one decode: a 10 ms step, one draft adds 5 ms (c = 0.5); two decodes: a 12 ms step, a
    # draft adds 0.6 ms (c = 0.05). One c for both (their median, 0.275) would give two decodes
    # fewer drafts than one; per size, the pair gets more (its drafts are nearly free) and the
    # single decode fewer (its drafts cost half a step each)
    spec = Speculator(NgramProposer(), max_k=8)
    for _ in range(4):
        spec.observe_batch(1, 0, 0, 0.010)
        spec.observe_batch(1, 1, 0, 0.015)
        spec.observe_batch(2, 0, 0, 0.012)
        spec.observe_batch(2, 1, 0, 0.0126)
    assert spec.draft_cost_for(1) == pytest.approx(0.5)
    assert spec.draft_cost_for(2) == pytest.approx(0.05)
    assert spec.draft_cost == pytest.approx(0.275)             # every size's samples
    assert spec.draft_cost_for(3) == spec.draft_cost           # 3-4 decodes: not measured yet
    r = req(PERIOD * 3, prompt_len=5)
    r.spec_state["_acceptance"] = [9.0, 1.0]                   # alpha = 0.9
    r.spec_state["_idle"] = 0
    one, two = spec.k_for(r, 1), spec.k_for(r, 2)
    assert two > one >= 1
    spec.cost = 0.275                                          # one c for every size ...
    assert spec.k_for(r, 2) <= spec.k_for(r, 1)                # ... and k only falls with size


def test_a_batch_of_decodes_asks_a_batching_proposer_once_and_each_gets_its_own_drafts():
    """propose_many: with a proposer that has propose_batch, one call for the pairs that ask for
    drafts (k > 0), each answer cut to its k and back in the batch's order; a k of 0 gets none
    and is not asked; a single ask and a proposer without propose_batch go one by one."""
    class Batching:
        name = "fake"

        def __init__(self):
            self.calls = []

        def propose(self, r, k):
            self.calls.append([(r.req_id, k)])
            return [int(r.req_id[1:])] * (k + 1)

        def propose_batch(self, asks):
            self.calls.append([(r.req_id, k) for r, k in asks])
            return [[int(r.req_id[1:])] * (k + 2) for r, k in asks]

    reqs = []
    for i in range(4):
        r = req(PERIOD * 2)
        r.req_id = f"r{i}"
        reqs.append(r)
    prop = Batching()
    spec = Speculator(prop, max_k=4)
    got = spec.propose_many([(reqs[0], 2), (reqs[1], 0), (reqs[2], 3), (reqs[3], 1)])
    assert got == [[0, 0], [], [2, 2, 2], [3]]
    assert prop.calls == [[("r0", 2), ("r2", 3), ("r3", 1)]]
    prop.calls.clear()
    assert spec.propose_many([(reqs[0], 0), (reqs[1], 2)]) == [[], [1, 1]]
    assert prop.calls == [[("r1", 2)]]                       # one ask: propose()
    del Batching.propose_batch
    prop.calls.clear()
    assert spec.propose_many([(reqs[0], 1), (reqs[1], 2)]) == [[0], [1, 1]]
    assert prop.calls == [[("r0", 1)], [("r1", 2)]]
