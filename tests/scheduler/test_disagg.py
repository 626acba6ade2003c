"""Prefill/decode disaggregation on simulated workers (scheduler_svc.pools, scheduler_svc.router):
routing in each mode, the handoff, and the faults, each ending with every block free."""
from __future__ import annotations

import pytest

from shared.sampling import InvalidRequestError, SamplingParams
from tests.support.sim_pools import all_free, make_pools, outputs

SP = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompt(i, n):
    return [1 + (i * 7 + j) % 400 for j in range(n)]


def run(ps, reqs, sp=SP, before=None):
    for rid, toks in reqs:
        ps.add_request(rid, toks, sp)
    if before is not None:
        before(ps)
    return outputs(ps.run_until_done())


REQS = [(f"r{i}", prompt(i, n)) for i, n in enumerate([5, 30, 17, 41, 8, 23])]


def reference(reqs=REQS, sp=SP):
    return run(make_pools(["mixed"]), reqs, sp)


def test_off_spreads_requests_over_mixed_pools_with_colocated_outputs():
    ps = make_pools(["mixed", "mixed"])
    for rid, toks in REQS:
        ps.add_request(rid, toks, SP)
    assert all(p.scheduler.requests for p in ps.pools)          # both pools got work
    assert outputs(ps.run_until_done()) == reference()
    assert all_free(ps) and not ps.transfers


def test_all_prefills_on_the_prefill_pool_and_decodes_on_the_decode_pool():
    ps = make_pools(["prefill", "decode"], "all")
    prefill, decode = ps.pools
    for rid, toks in REQS:
        ps.add_request(rid, toks, SP)
    assert len(prefill.scheduler.requests) == len(REQS)
    out = outputs(ps.run_until_done())
    assert out == reference()                                    # the moved KV is the computed KV
    assert sorted(t.req_id for t in ps.transfers) == sorted(r for r, _ in REQS)
    assert prefill.scheduler.stats()["num_handed_off"] == len(REQS)
    assert decode.scheduler.stats()["num_adopted"] == len(REQS)
    # the prefill worker sampled only first tokens; every later token came from the decode worker
    assert prefill.executor.computed_tokens == sum(len(t) for _, t in REQS)
    assert decode.executor.kv_blocks_received == sum(-(-len(t) // 4) for _, t in REQS)
    assert all(t.kv_bytes > 0 for t in ps.transfers)
    assert all_free(ps)


def test_auto_disaggregates_only_prompts_at_least_the_threshold():
    ps = make_pools(["prefill", "decode"], "auto", threshold=20)
    prefill, decode = ps.pools
    ps.add_request("short", prompt(0, 19), SP)
    ps.add_request("long", prompt(1, 20), SP)
    assert set(decode.scheduler.requests) == {"short"} and set(prefill.scheduler.requests) == {"long"}
    assert outputs(ps.run_until_done()) == reference([("short", prompt(0, 19)), ("long", prompt(1, 20))])
    assert [t.req_id for t in ps.transfers] == ["long"] and all_free(ps)


def test_auto_keeps_long_prompts_colocated_when_the_prefill_pool_is_the_bottleneck():
    ps = make_pools(["prefill", "decode"], "auto", threshold=10, backlog_margin=50)
    prefill, decode = ps.pools
    for i in range(3):
        ps.add_request(f"q{i}", prompt(i, 30), SP)   # 30, 60 queued: the third exceeds 0 + 50
    assert set(prefill.scheduler.requests) == {"q0", "q1"} and set(decode.scheduler.requests) == {"q2"}
    ps.run_until_done()
    assert all_free(ps)


def test_auto_does_not_disaggregate_a_prompt_mostly_cached_on_the_decode_pool():
    ps = make_pools(["prefill", "decode"], "auto", threshold=12, prefix_caching=True)
    prefill, decode = ps.pools
    base = prompt(3, 40)
    ps.add_request("first", base, SP)                 # 40 uncached: prefilled, handed off
    ps.run_until_done()
    ps.add_request("again", base[:40] + [5, 6, 7], SP)   # 40 cached on the decode pool, 3 new
    assert set(decode.scheduler.requests) == {"again"}
    ps.run_until_done()
    assert [t.req_id for t in ps.transfers] == ["first"]


def test_all_sends_only_blocks_not_cached_on_the_decode_pool():
    ps = make_pools(["prefill", "decode"], "all", prefix_caching=True)
    prefill, decode = ps.pools
    base = prompt(4, 32)
    ps.add_request("a", base, SP)
    ps.run_until_done()
    got = decode.executor.kv_blocks_received
    ps.add_request("b", base + [9, 9, 9, 9, 9], SP)   # 37 tokens: 8 cached blocks on the decode pool
    out = outputs(ps.run_until_done())
    assert decode.executor.kv_blocks_received - got == 2   # blocks 8 and 9 only
    assert out["b"] == reference([("b", base + [9] * 5)])["b"]


def test_a_request_that_ends_with_its_first_token_finishes_on_the_prefill_pool():
    ps = make_pools(["prefill", "decode"], "all")
    one = SamplingParams(temperature=0.0, max_tokens=1)
    out = run(ps, [("x", prompt(0, 12))], one)
    assert len(out["x"]) == 1 and not ps.transfers and all_free(ps)
    ps2 = make_pools(["prefill", "decode"], "all", scripts={"y": [0]})   # EOS as first token
    out2 = run(ps2, [("y", prompt(1, 12))], SamplingParams(temperature=0.0, max_tokens=5))
    assert out2["y"] == [0] and all_free(ps2)


def test_a_failed_transfer_is_recomputed_colocated():
    ps = make_pools(["prefill", "decode"], "all")
    ps.pools[0].executor.kv_fail = lambda send: "timeout" if send.req_id in ("r1", "r3") else None
    assert run(ps, REQS) == reference()
    assert ps.counters["num_kv_failed"] == 2 and len(ps.transfers) == len(REQS) - 2
    assert all_free(ps)


def test_a_failed_transfer_fails_the_request_with_kv_transfer_failure_fail():
    ps = make_pools(["prefill", "decode"], "all", failure="fail")
    ps.pools[0].executor.kv_fail = lambda send: "timeout" if send.req_id == "r1" else None
    for rid, toks in REQS:
        ps.add_request(rid, toks, SP)
    events = ps.run_until_done()
    end = {e.req_id: e for e in events if e.finish_reason}
    assert end["r1"].finish_reason == "error" and "timeout" in end["r1"].error and end["r1"].index == 1
    assert all(end[r].finish_reason == "length" for r, _ in REQS if r != "r1")
    assert all_free(ps)


def test_an_abort_during_prefill_frees_both_sides():
    ps = make_pools(["prefill", "decode"], "all", token_budget=8)
    ps.add_request("a", prompt(0, 40), SP)
    ps.step()                                    # first chunk of 8 done, more to come
    ps.abort("a")
    events = ps.run_until_done()
    assert [e.finish_reason for e in events] == ["abort"] and all_free(ps)


def test_an_abort_during_the_transfer_frees_both_sides():
    ps = make_pools(["prefill", "decode"], "all")
    prefill = ps.pools[0]
    ps.add_request("a", prompt(0, 12), SP)
    prefill.executor.kv_fail = lambda send: ps.abort("a")   # arrives while the batch is out
    events = ps.run_until_done()
    assert [e.finish_reason for e in events][-1] == "abort" and not ps.transfers
    assert all_free(ps)


def test_a_lost_prefill_worker_s_requests_go_to_another_prefill_pool():
    ps = make_pools(["prefill", "prefill", "decode"], "all", token_budget=8)
    for rid, toks in REQS:
        ps.add_request(rid, toks, SP)
    events = ps.step()
    ps.pools[0].executor.lose()
    out = outputs(events + ps.run_until_done())
    assert out == reference() and ps.counters["num_pools_lost"] == 1
    assert all_free(ps)


def test_a_lost_prefill_worker_s_requests_run_colocated_when_no_prefill_pool_is_up():
    ps = make_pools(["prefill", "decode"], "all", token_budget=8)
    for rid, toks in REQS:
        ps.add_request(rid, toks, SP)
    events = ps.step()
    ps.pools[0].executor.lose()
    events += ps.step()
    assert not ps.pools[0].up and set(ps.pools[1].scheduler.requests) == {r for r, _ in REQS}
    assert outputs(events + ps.run_until_done()) == reference() and all_free(ps)


def test_a_decode_worker_lost_mid_transfer_and_later_costs_a_recompute_not_a_token():
    ps = make_pools(["prefill", "decode", "decode"], "all")
    prefill, d1, d2 = ps.pools

    def die_mid_transfer(send):
        if send.req_id == "r2":
            d = next(p for p in ps.pools if p.kv_address == send.dst_address)
            d.executor.lose()
            return "receiver disconnected"
        return None

    prefill.executor.kv_fail = die_mid_transfer
    for rid, toks in REQS:
        ps.add_request(rid, toks, SP)
    events = []
    for _ in range(6):
        events += ps.step()
    alive = d1 if d1.up else d2
    assert alive.scheduler.running                # it decodes adopted requests
    alive.executor.lose()                         # later: while it decodes adopted requests
    out = outputs(events + ps.run_until_done())
    assert out == reference() and ps.counters["num_pools_lost"] == 2
    assert all_free(ps)


def test_requests_wait_for_a_lost_pool_and_resume_when_it_answers():
    ps = make_pools(["mixed"])
    ps.add_request("a", prompt(0, 10), SP)
    events = ps.step()
    ex = ps.pools[0].executor
    ex.lose()
    events += ps.step()
    assert ps.orphans and not ps.pools[0].up
    ex.down = False
    ps._last_revive = 0.0
    events += ps.run_until_done()
    assert outputs(events) == reference([("a", prompt(0, 10))]) and all_free(ps)


def test_without_room_on_the_decode_pool_a_request_decodes_where_it_was_prefilled():
    ps = make_pools(["prefill", "decode"], "all", num_blocks=12)   # 12 blocks of 4: one 41-token prompt
    prefill, decode = ps.pools
    reqs = [("big", prompt(0, 41)), ("next", prompt(1, 30))]
    out = run(ps, reqs)
    assert out == reference(reqs)
    assert ps.counters["num_handoff_no_room"] >= 1 and prefill.scheduler.stats()["num_finished"] >= 1
    assert all_free(ps)


def test_a_duplicate_request_id_is_refused_whichever_pool_holds_it():
    ps = make_pools(["prefill", "decode"], "all")
    ps.add_request("a", prompt(0, 10), SP)
    with pytest.raises(InvalidRequestError):
        ps.add_request("a", prompt(0, 10), SP)


def test_a_simulated_transfer_cost_is_a_separate_visible_term_of_the_ttft():
    ps = make_pools(["prefill", "decode"], "all")
    ps.pools[0].executor.kv_cost = lambda send: 0.5 * len(send.src_blocks)   # seconds per block
    ps.add_request("a", prompt(0, 10), SP)                                   # 3 blocks
    ps.run_until_done()
    (rec,) = ps.transfers
    assert rec.kv_transfer_s == 1.5 and rec.prefill_s == 0.0 and rec.queue_s == 0.0


def test_mixed_pools_with_async_scheduling_give_the_colocated_outputs():
    """Several colocated workers (`--workers N`) with async scheduling: each pool plans its next
    batch ahead; the tokens are the synchronous single pool's and every block comes back."""
    ps = make_pools(["mixed", "mixed"], async_scheduling=True)
    assert all(p.loop.ahead for p in ps.pools)
    assert run(ps, REQS) == reference() and all_free(ps)


def test_a_lost_mixed_worker_with_async_scheduling_costs_a_recompute_not_a_token():
    """Two batches in flight when the worker dies (one planned ahead): both are lost, the
    requests are recomputed with the tokens they had, and nothing is emitted twice or skipped."""
    ps = make_pools(["mixed", "mixed"], async_scheduling=True, token_budget=8)
    for rid, toks in REQS:
        ps.add_request(rid, toks, SP)
    events = []
    for _ in range(4):
        events += ps.step()
    # a step collects one batch a pool and leaves the one planned ahead in flight (without async
    # scheduling none): the next step fills a second, then finds the worker dead
    assert [len(p.loop.in_flight) for p in ps.pools] == [1, 1]
    ps.pools[0].executor.lose()
    assert outputs(events + ps.run_until_done()) == reference() and all_free(ps)
