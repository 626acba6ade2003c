"""Speculative decoding beside the scheduler's other features, with the simulated worker (which
judges drafts as a greedy model would, so outputs must equal those without drafts): preemption,
prefix caching, prompt sharing (n > 1), requests that may not be given drafts (penalties, an
output constraint, seeded sampling, the per-request opt-out) and the request body's field."""
from __future__ import annotations

from gateway.protocol import ChatCompletionRequest
from scheduler_svc.sim_executor import sim_engine
from shared.sampling import SamplingParams

PERIOD = [11, 12, 13, 14, 15, 16, 17]


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def outputs(speculative, reqs, scripts, draft_cost=None, **kw):
    loop = sim_engine(speculative=speculative, scripts=scripts, **kw)
    if draft_cost is not None:    # the untimed sim measures no cost: what a draft is taken to cost
        loop.scheduler.speculator.default_cost = draft_cost
    handles = [loop.add_request(rid, prompt, sp, share_prompt_with=share)
               for rid, prompt, sp, share in reqs]
    drafted = {}
    schedule = loop.scheduler.schedule

    def spy():
        batch = schedule()
        for s in batch.seqs if batch else ():
            drafted[s.req_id] = drafted.get(s.req_id, 0) + s.num_draft_tokens
        return batch
    loop.scheduler.schedule = spy
    loop.run_until_done()
    return [h.output_token_ids for h in handles], drafted, loop


def scripted(ids, length=40):
    return {r: (PERIOD * 8)[:length] for r in ids}


def test_preemption_with_drafts_gives_the_outputs_of_ample_memory():
    reqs = [(f"r{i}", PERIOD * 2, greedy(24), None) for i in range(3)]
    scripts = scripted([r[0] for r in reqs], 10)   # then hashed from the context read back
    ample, _, _ = outputs("off", reqs, scripts, block_size=4, num_blocks=256, max_model_len=64)
    tight, drafted, loop = outputs("ngram", reqs, scripts, block_size=4, num_blocks=16, max_model_len=64)
    assert tight == ample
    st = loop.scheduler.stats()
    assert st["num_preemptions"] > 0 and sum(drafted.values()) > 0
    assert st["num_free_blocks"] == 16


def test_prefix_caching_with_drafts_gives_the_same_outputs():
    """b arrives after a finished: it finds a's prompt, and the blocks a's drafts wrote past
    its accepted tokens were never keyed (verify_kv would read them back wrong)."""
    prompt = PERIOD * 4
    scripts = scripted(["a", "b"], 12)    # then tokens hashed from the context read back
    got = {}
    for speculative, caching in (("off", False), ("ngram", True)):
        loop = sim_engine(speculative=speculative, scripts=scripts, block_size=4, num_blocks=128,
                          max_model_len=128, enable_prefix_caching=caching)
        a = loop.add_request("a", prompt, greedy(20))
        loop.run_until_done()
        b = loop.add_request("b", prompt + a.output_token_ids[:9], greedy(20))
        loop.run_until_done()
        got[speculative] = (a.output_token_ids, b.output_token_ids, loop.scheduler.stats())
    assert got["ngram"][:2] == got["off"][:2]
    st = got["ngram"][2]
    assert st["prefix_cache_hit_tokens"] >= len(prompt) and st["spec_accepted_tokens"] > 0


def test_siblings_sharing_a_prompt_both_speculate():
    prompt = PERIOD * 3
    reqs = [("c0", prompt, greedy(16), None), ("c1", prompt, greedy(16), "c0")]
    scripts = scripted(["c0", "c1"])
    off, _, _ = outputs("off", reqs, scripts, block_size=4, num_blocks=128, max_model_len=128)
    on, drafted, _ = outputs("ngram", reqs, scripts, block_size=4, num_blocks=128, max_model_len=128)
    assert on == off and drafted["c0"] > 0 and drafted["c1"] > 0


def test_requests_that_may_not_speculate_get_no_drafts_and_constrained_ones_do():
    kinds = {"penalty": greedy(16, repetition_penalty=1.3),
             "grammar": SamplingParams(temperature=0.0, max_tokens=16, constraint='{"grammars": []}'),
             "seeded": SamplingParams(temperature=0.7, seed=1, max_tokens=16, ignore_eos=True),
             "opt_out": greedy(16, speculative=False),
             "plain": greedy(16)}
    reqs = [(k, PERIOD * 3, sp, None) for k, sp in kinds.items()]
    _, drafted, _ = outputs("ngram", reqs, scripted(kinds), draft_cost=0.01, block_size=4,
                            num_blocks=128, max_model_len=128)
    assert drafted["plain"] > 0 and drafted["grammar"] > 0    # a constraint masks each draft's row
    assert all(drafted[k] == 0 for k in ("penalty", "seeded", "opt_out"))


def test_the_request_body_field_opts_out():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest(**body).sampling(8).speculative is True
    assert ChatCompletionRequest(**body, speculative=False).sampling(8).speculative is False


def test_disaggregated_decodes_speculate_with_the_same_outputs():
    from scheduler_svc.speculative import NgramProposer, Speculator
    from tests.support.sim_pools import all_free, make_pools
    from tests.support.sim_pools import outputs as event_outputs

    reqs = [(f"d{i}", (PERIOD * 4)[i:i + 14 + 3 * i]) for i in range(4)]
    scripts = {rid: (PERIOD * 6)[:30] for rid, _ in reqs}
    sp = greedy(24)

    def run(roles, mode, speculate):
        ps = make_pools(roles, mode, scripts=scripts, num_blocks=128)
        if speculate:
            for p in ps.pools:
                p.scheduler.speculator = Speculator(NgramProposer(), 4)
        for rid, toks in reqs:
            ps.add_request(rid, toks, sp)
        return event_outputs(ps.run_until_done()), ps

    want, _ = run(["mixed"], "off", False)
    got, ps = run(["prefill", "decode"], "all", True)
    assert got == want
    prefill, decode = ps.pools
    assert decode.scheduler.stats()["spec_accepted_tokens"] > 0
    assert len(ps.transfers) == len(reqs) and all_free(ps)
