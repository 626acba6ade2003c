"""Routing across simulated replicas (sarathi.measure.routing) and the multi-turn chat workload:
the shared queue's pull, the endpoint picker's scorers (queue, KV usage, prefix cache from the KV
events), all over the real scheduler."""
from __future__ import annotations

import dataclasses

import pytest

from sarathi.measure.gpu_costmodel import GPUCostModel
from sarathi.measure.loadgen import ChatShape, RequestSpec, bench_sampling, make_chat_workload, sim_output_tokens
from sarathi.measure.routing import Picker
from sarathi.measure.simulate import KVTier, Replica, TieredBlockManager, run_replicas
from sarathi.measure.trace import Trace
from scheduler_svc.kv_events import KVEventRecorder, prefix_hashes
from scheduler_svc.request import Request
from shared.config import SchedulerConfig
from shared.sampling import SamplingParams

TRACE = Trace([200, 400, 800, 100], [20, 40, 10, 30], "test")
COST = GPUCostModel("llama-3-8b", "a100")


def replicas(n: int, prefix: bool = True, **kw) -> list[Replica]:
    cfg = SchedulerConfig(token_budget=512, max_model_len=8192, enable_prefix_caching=prefix, **kw)
    return [Replica(COST, cfg, block_size=16, num_blocks=4096, max_model_len=8192, seed=i) for i in range(n)]


def test_chat_turns_extend_the_previous_turn_and_share_system_prompts():
    shape = ChatShape(system_prompts=2, system_len=64, turns=(3, 3), user_scale=0.1, think_s=1.0)
    w = make_chat_workload(TRACE, 30, 2.0, shape, seed=1)
    assert len(w) == 30 and [s.arrival for s in w] == sorted(s.arrival for s in w)
    by_conv: dict[str, list[RequestSpec]] = {}
    for s in w:
        by_conv.setdefault(s.req_id.split("t")[0], []).append(s)
    assert len({tuple(s.prompt_ids[:64]) for s in w}) == 2          # two shared system prompts
    for turns in by_conv.values():
        turns.sort(key=lambda s: int(s.req_id.split("t")[1]))
        for prev, nxt in zip(turns, turns[1:]):
            n = len(prev.prompt_ids)
            assert nxt.arrival > prev.arrival
            assert nxt.prompt_ids[:n] == prev.prompt_ids             # the growing prefix
            assert nxt.prompt_ids[n:n + prev.max_tokens] == sim_output_tokens(n, prev.max_tokens, 32000)
            assert len(nxt.prompt_ids) > n + prev.max_tokens           # plus a new user message


def check_follow_ups(workload: list[RequestSpec], records) -> int:
    """Every follow-up recorded arrived no earlier than its scheduled time, nor than its think
    time after the answer before it ended, nor later than the last scheduled arrival. Returns
    how many were recorded."""
    spec = {s.req_id: s for s in workload}
    rec = {r.req_id: r for r in records}
    last = max(s.arrival for s in workload)
    seen = 0
    for rid, r in rec.items():
        s = spec[rid]
        if s.after not in spec:   # none, or a turn from before the workload: no constraint
            continue
        seen += 1
        prev = rec[s.after]
        assert prev.finished and r.arrival >= s.arrival - 1e-9
        assert r.arrival >= prev.token_times[-1] + s.think_s - 1e-9
        assert r.arrival <= last + 1e-9
    return seen


def test_a_follow_up_waits_for_the_answer_it_replies_to_when_the_workload_asks():
    # answers estimated at 1 ms a token: on the open-loop schedule follow-ups are due long before
    # the answers they reply to can end
    shape = ChatShape(system_len=64, turns=(3, 3), user_scale=0.1, think_s=0.2, answer_s_per_token=0.001)
    opened = make_chat_workload(TRACE, 60, 10.0, shape, seed=3)
    waited = make_chat_workload(TRACE, 60, 10.0, dataclasses.replace(shape, wait_for_answer=True), seed=3)
    assert [(s.req_id, s.arrival, s.prompt_ids) for s in opened] == \
        [(s.req_id, s.arrival, s.prompt_ids) for s in waited]        # the same workload, plus the order
    assert all(s.after is None for s in opened)
    assert all(s.after == f"{s.req_id.split('t')[0]}t{int(s.req_id.split('t')[1]) - 1}"
               for s in waited if not s.req_id.endswith("t0"))
    run, _ = run_replicas(replicas(1), opened, drain_s=60)
    rec = {r.req_id: r for r in run.records}
    early = [s for s in waited if s.after in rec and rec[s.req_id].arrival < rec[s.after].token_times[-1]]
    assert early                                          # open loop: sent before its answer ended
    run, _ = run_replicas(replicas(1), waited, drain_s=60)
    assert check_follow_ups(waited, run.records) > 10
    assert {r.req_id for r in run.records} <= {s.req_id for s in waited}
    assert all(r.finished for r in run.records)
    # the in-process runner (one engine) follows the same rule
    from sarathi.measure.loadgen import run_inprocess
    from scheduler_svc.sim_executor import sim_engine
    res = run_inprocess(sim_engine(max_model_len=8192, num_blocks=4096), waited, drain_s=60)
    assert check_follow_ups(waited, res.records) > 10


def test_prefix_routing_keeps_a_conversation_where_its_history_is_cached():
    w = make_chat_workload(TRACE, 60, 1.0, ChatShape(system_len=128, turns=(4, 4), think_s=2.0), seed=2)
    results = {}
    for routing in ("shared-queue", "prefix", "mix"):
        routes: dict[str, int] = {}
        _, extra = run_replicas(replicas(4), w, drain_s=60, routing=routing, routes=routes)
        results[routing] = (extra["prefix_hit_rate"], routes)
    for routing in ("prefix", "mix"):
        routes = results[routing][1]
        for rid, i in routes.items():
            conv, turn = rid.split("t")
            prev = f"{conv}t{int(turn) - 1}"
            if prev in routes:      # (the turn before may have arrived before the run started)
                assert routes[prev] == i, (routing, rid)
        assert results[routing][0] > results["shared-queue"][0] + 0.1


def test_an_idle_replica_takes_a_shared_queue_request_at_once_a_busy_one_at_its_boundary():
    reps = replicas(2)
    specs = [RequestSpec(f"r{i}", t, list(range(100, 400)), 50) for i, t in enumerate((0.0, 0.0, 0.001))]
    routes: dict[str, int] = {}
    rr, extra = run_replicas(reps, specs, drain_s=30, routing="shared-queue", routes=routes)
    assert routes["r0"] == 0 and routes["r1"] == 1           # both idle: each takes one at arrival
    assert routes["r2"] in (0, 1) and all(r.finished for r in rr.records)
    assert extra["replica_requests"] == [2, 1] or extra["replica_requests"] == [1, 2]
    r2 = next(r for r in rr.records if r.req_id == "r2")
    first_iteration_end = min(r.token_times[0] for r in rr.records if r.req_id != "r2")
    assert r2.first_scheduled >= first_iteration_end > r2.arrival   # pulled at a boundary, not at once


def test_the_picker_scores_queue_kv_and_prefix_as_the_endpoint_picker():
    reps = replicas(3)
    pref = Picker("prefix", reps, 16)      # its index follows the replicas' KV events from now on
    prompt = list(range(1000, 1000 + 64))
    reps[1].engine.add_request("warm", prompt, bench_sampling(1))
    reps[1].engine.run_until_done()                              # replica 1 holds the prompt's 4 blocks
    longer = prompt + [7] * 16
    _, matched = pref.scores(longer)
    assert matched == [0, 4, 0] and pref.pick(longer) == 1
    for k in range(3):                                           # replica 0: a waiting queue of 3
        reps[0].engine.add_request(f"q{k}", list(range(10, 20)), bench_sampling(1))
    scores, _ = Picker("least-queue", reps, 16).scores(prompt)
    assert scores[0] < scores[1] and scores[0] < scores[2]     # the longest queue scores lowest
    reps[1].scheduler.on_workers_lost()                          # a restart: AllBlocksCleared
    assert pref.scores(longer)[1] == [0, 0, 0]
    with pytest.raises(ValueError, match="prefix caching"):
        Picker("mix", replicas(2, prefix=False), 16)


def test_warm_up_turns_run_first_and_stay_out_of_the_results():
    import dataclasses

    shape = ChatShape(system_len=64, turns=(3, 3), user_scale=0.1, think_s=1.0, warmup_s=10.0)
    w = make_chat_workload(TRACE, 40, 2.0, shape, seed=3)
    warm = [s for s in w if s.arrival < 0]
    measured = [s for s in w if s.arrival >= 0]
    assert warm and len(measured) == 40 and min(s.arrival for s in warm) >= -10.0 * 1.5
    assert abs((measured[-1].arrival - measured[0].arrival) - 39 / 2.0) < 1e-6   # exactly 2 QPS
    rr, extra = run_replicas(replicas(2), w, drain_s=60, routing="mix")
    assert {r.req_id for r in rr.records} == {s.req_id for s in measured}
    assert extra["warmup_requests"] == len(warm)
    assert min(r.arrival for r in rr.records) == 0.0 and all(r.finished for r in rr.records)
    assert all(it.start >= 0 for it in rr.iterations)
    cold = run_replicas(replicas(2), [dataclasses.replace(s) for s in measured], drain_s=60, routing="mix")[1]
    assert extra["prefix_hit_rate"] > cold["prefix_hit_rate"]   # the warm-up filled the caches


@pytest.mark.parametrize("mode, settings, richer, blind", [
    ("weights", "1:0:0,0:1:1", "1:0:0", "0:1:1"),     # all prefix against all load
    ("kvcost", "0,64", "64", "0"),                     # weight 0: KV blocks alone, blind to the cache
])
def test_a_sweep_runs_each_setting_and_restores_the_default(tmp_path, mode, settings, richer, blind):
    """bench.routing weights (the mix's prefix:queue:kv) and kvcost (kv-cost's overlap weight):
    one run per (setting, rate), the settings really differ (the one that weighs the prefix cache
    finds more cached than the one blind to it), and the defaults are back afterwards."""
    import json

    from bench.routing import main
    from sarathi.measure import routing as R

    before = dict(R.WEIGHTS["mix"]), R.KV_COST_OVERLAP_WEIGHT
    main([mode, "--replicas", "2", "--workloads", "chat", "--duration", "4", "--warmup", "4",
          "--num-requests", "60", "--qps-list", "4", "--weights-list", settings, "--out", str(tmp_path)])
    assert (dict(R.WEIGHTS["mix"]), R.KV_COST_OVERLAP_WEIGHT) == before
    res = json.loads((tmp_path / f"routing_chat_2r_{mode}.json").read_text())
    assert [(r["weights"], r["qps"]) for r in res["runs"]] == [(x, 4.0) for x in settings.split(",")]
    hits = {r["weights"]: r["summary"]["prefix_hit_rate"] for r in res["runs"]}
    assert hits[richer] > hits[blind]
    assert (tmp_path / f"routing_chat_2r_{mode}.png").stat().st_size > 0


def test_the_low_queue_filter_overrides_the_prefix_cache_above_its_threshold():
    """mix-lowq: the replica holding the prompt's prefix wins while its queue is at most the
    threshold; above it, the filter leaves only shorter queues (the prefix no longer counts); when
    every queue is above it, the least queued replicas are what is left."""
    from sarathi.measure import routing as R
    from scheduler_svc.kv_events import BlockStored

    t = R.LOW_QUEUE_THRESHOLD
    prompt = list(range(100, 164))                      # 4 full blocks of 16
    for routing, held_by_busy_wins in (("mix", True), ("mix-lowq", False)):
        sc = R.Scorer(routing, 3, block_size=16, seed=0)
        sc.index.sink(0)(BlockStored(block_hashes=sc._hashes(prompt), parent_block_hash=None,
                                     token_ids=prompt, block_size=16))
        assert sc.choose(prompt, waiting=[t, 0, 1], kv_usage=[0.5, 0.5, 0.5]) == 0     # at the threshold
        got = sc.choose(prompt, waiting=[t + 1, 0, 1], kv_usage=[0.5, 0.5, 0.5])
        assert (got == 0) is held_by_busy_wins, routing
    sc = R.Scorer("mix-lowq", 3, block_size=16, seed=0)
    assert sc.choose(prompt, waiting=[t + 9, t + 3, t + 5], kv_usage=[0.0, 0.9, 0.9]) == 1


def test_the_low_queue_sweep_runs_the_mix_with_and_without_the_filter_and_restores_it(tmp_path):
    import json

    from bench.routing import main
    from sarathi.measure import routing as R

    before = R.LOW_QUEUE_THRESHOLD
    main(["lowq", "--replicas", "2", "--workloads", "chat", "--duration", "4", "--warmup", "4",
          "--num-requests", "60", "--qps-list", "4", "--thresholds", "0,8", "--out", str(tmp_path)])
    assert R.LOW_QUEUE_THRESHOLD == before
    res = json.loads((tmp_path / "routing_chat_2r_lowq.json").read_text())
    assert [(r["threshold"], r["qps"]) for r in res["runs"]] == [(None, 4.0), (0, 4.0), (8, 4.0)]
    assert all(r["summary"]["routing"] == ("mix" if r["threshold"] is None else "mix-lowq") for r in res["runs"])
    assert (tmp_path / "routing_chat_2r_lowq.png").stat().st_size > 0


def test_flow_control_saturation_is_the_mean_roofline_and_its_filter_overrides_the_prefix():
    """mix-fc: a replica's saturation is max(waiting / SATURATION_QUEUE, KV usage / SATURATION_KV),
    the pool holds requests when the mean reaches 1; the detector's filter takes a saturated
    replica out of the candidates, whatever it caches, unless every replica is saturated."""
    from sarathi.measure import routing as R
    from scheduler_svc.kv_events import BlockStored

    q, kv = R.SATURATION_QUEUE, R.SATURATION_KV
    sc = R.Scorer("mix-fc", 3, block_size=16, seed=0)
    assert not sc.saturated(waiting=[q - 1, q - 1, q - 1], kv_usage=[0.0, 0.0, kv * 0.9])
    assert sc.saturated(waiting=[3 * q, 0, 0], kv_usage=[0.0, 0.0, 0.0])          # mean 1: one hot replica
    assert sc.saturated(waiting=[0, 0, 0], kv_usage=[kv, kv, kv])
    assert not sc.saturated(waiting=[3 * q - 1, 0, 0], kv_usage=[0.0, 0.0, 0.0])
    prompt = list(range(100, 164))
    sc.index.sink(0)(BlockStored(block_hashes=sc._hashes(prompt), parent_block_hash=None, token_ids=prompt,
                                 block_size=16))
    assert sc.choose(prompt, waiting=[q - 1, 0, 0], kv_usage=[0.5, 0.0, 0.0]) == 0      # not saturated: cached wins
    assert sc.choose(prompt, waiting=[q, 0, 1], kv_usage=[0.5, 0.0, 0.0]) != 0          # saturated: filtered out
    assert sc.choose(prompt, waiting=[0, 0, 1], kv_usage=[kv, 0.0, 0.0]) != 0           # by its KV usage too
    assert sc.choose(prompt, waiting=[q + 4, q, q + 1], kv_usage=[0.5, 0.5, 0.5]) == 0  # all saturated: all count
    before = R.SATURATION_FILTER
    try:
        R.SATURATION_FILTER = False                                                     # the gate alone
        assert sc.choose(prompt, waiting=[q, 0, 1], kv_usage=[0.5, 0.0, 0.0]) == 0
    finally:
        R.SATURATION_FILTER = before


def test_flow_control_holds_a_burst_in_the_picker_and_loses_none_of_it():
    """A burst far above what the replicas hold: under mix-fc no replica's queue ever passes the
    saturation threshold (the rest waits in the picker), every request still finishes, and none
    starts before it arrived; pushed by the plain mix, the replicas' queues take the burst."""
    from sarathi.measure import routing as R

    burst = [RequestSpec(f"r{i}", 0.01 * i, [7] * 16 + list(range(1000 + 40 * i, 1040 + 40 * i + 200)), 20)
             for i in range(60)]

    def run(routing: str) -> tuple[int, object]:
        reps = replicas(2, max_num_seqs=4)
        most = 0
        for rep in reps:
            add = rep.engine.add_request

            def counted(*args, _add=add, _s=rep.scheduler, **kw):
                nonlocal most
                out = _add(*args, **kw)
                most = max(most, len(_s.waiting))
                return out
            rep.engine.add_request = counted
        result, extra = run_replicas(reps, burst, drain_s=120, routing=routing)
        assert sum(extra["replica_requests"]) == len(burst)
        return most, result

    held_most, held = run("mix-fc")
    pushed_most, _ = run("mix")
    assert held_most <= R.SATURATION_QUEUE < pushed_most
    assert len(held.records) == len(burst) and all(r.finished for r in held.records)
    assert all(r.first_scheduled >= r.arrival - 1e-9 for r in held.records)


def test_the_flow_control_sweep_runs_the_mix_without_it_and_both_ways_with_it_and_restores_it(tmp_path):
    import json

    from bench.routing import main
    from sarathi.measure import routing as R

    before = R.SATURATION_FILTER
    main(["fc", "--replicas", "2", "--workloads", "chat", "--duration", "4", "--warmup", "4",
          "--num-requests", "60", "--qps-list", "4", "--out", str(tmp_path)])
    assert R.SATURATION_FILTER == before
    res = json.loads((tmp_path / "routing_chat_2r_fc.json").read_text())
    assert [(r["weights"], r["qps"]) for r in res["runs"]] == [
        ("no flow control", 4.0), ("gate + filter", 4.0), ("gate alone", 4.0)]
    assert [r["summary"]["routing"] for r in res["runs"]] == ["mix", "mix-fc", "mix-fc"]
    assert (tmp_path / "routing_chat_2r_fc.png").stat().st_size > 0


def test_kv_cost_trades_the_prefill_a_hit_saves_against_the_work_queued_behind_it():
    """kv-cost (Dynamo's KV router): cost = weight x (pending prefill + this prompt's uncached
    tokens) / block size + KV blocks held, the lowest wins. The replica holding the prompt wins
    while the prefill it saves outweighs what it has queued; with more queued than the prompt's
    length it loses; KV blocks held count block for block; a higher overlap weight makes the
    saved prefill count for more against the blocks held."""
    from sarathi.measure import routing as R
    from scheduler_svc.kv_events import BlockStored

    prompt = list(range(100, 164)) + [5] * 8           # 4 full blocks of 16, then 8 tokens
    sc = R.Scorer("kv-cost", 3, block_size=16, seed=0)
    sc.index.sink(0)(BlockStored(block_hashes=sc._hashes(prompt)[:4], parent_block_hash=None,
                                 token_ids=prompt[:64], block_size=16))
    cost, matched = sc.costs(prompt, pending_prefill=[0, 0, 0], active_blocks=[0, 0, 0])
    assert matched == [4, 0, 0]
    assert cost.tolist() == [8 / 16 + 5, 72 / 16 + 5, 72 / 16 + 5]       # decode: the prompt's 5 blocks
    assert sc.choose(prompt, pending_prefill=[63, 0, 0], active_blocks=[0, 0, 0]) == 0
    assert sc.choose(prompt, pending_prefill=[65, 0, 0], active_blocks=[0, 0, 0]) != 0
    assert sc.choose(prompt, pending_prefill=[0, 0, 0], active_blocks=[5, 0, 0]) != 0   # 5 blocks > 4 saved
    before = R.KV_COST_OVERLAP_WEIGHT
    try:
        R.KV_COST_OVERLAP_WEIGHT = 2.0
        assert sc.choose(prompt, pending_prefill=[0, 0, 0], active_blocks=[5, 0, 0]) == 0   # 8 saved > 5
    finally:
        R.KV_COST_OVERLAP_WEIGHT = before


def test_kv_cost_releases_a_requests_prefill_at_its_first_token():
    """The simulated router keeps each replica's pending prefill as Dynamo's does: the uncached
    tokens of what it sent, until the request's first token; afterwards only its KV blocks count."""
    reps = replicas(2)
    pk = Picker("kv-cost", reps, 16)
    prompt = list(range(1000, 1000 + 200))
    i = pk.pick(prompt, "a")
    reps[i].engine.add_request("a", prompt, bench_sampling(30), 0.0)
    assert pk.sent[i] == {"a": 200}
    j = pk.pick(list(range(5000, 5200)), "b")
    assert j != i                                         # 200 tokens pending on i: b goes to the other
    reps[j].engine.add_request("b", list(range(5000, 5200)), bench_sampling(30), 0.0)
    while not reps[i].scheduler.requests["a"].num_output_tokens:
        reps[i].engine.step()
    pk.pick([9] * 40, "c")
    assert "a" not in pk.sent[i] and pk.sent[j]["b"] == 200       # b: still no token


def test_cache_aware_follows_the_longest_match_unless_the_loads_are_imbalanced():
    """cache-aware (SGLang's router): the replica with the longest match when it holds more than
    the threshold of the prompt (ties: the least loaded); below it, the replica caching the least;
    when the loads are imbalanced by both the absolute and the relative threshold, the least
    loaded, whatever it caches."""
    from sarathi.measure import routing as R
    from scheduler_svc.kv_events import BlockStored

    prompt = list(range(100, 164))                      # 4 full blocks
    other = list(range(900, 996))                       # 6 blocks of something else
    sc = R.Scorer("cache-aware", 3, block_size=16, seed=0)
    sc.index.sink(1)(BlockStored(block_hashes=sc._hashes(prompt), parent_block_hash=None, token_ids=prompt,
                                 block_size=16))
    sc.index.sink(0)(BlockStored(block_hashes=sc._hashes(other), parent_block_hash=None, token_ids=other,
                                 block_size=16))
    a = R.CACHE_AWARE_BALANCE_ABS
    assert sc.choose(prompt, [0, a, 0]) == 1                          # not imbalanced: max 64 - 0 is not > 64
    assert sc.choose(prompt, [0, a + 1, 0]) != 1                      # imbalanced: the least loaded
    assert sc.choose(prompt, [200, a + 201, 200]) == 1                # 265 < 1.5 x 200: not imbalanced
    assert sc.choose(list(range(3000, 3064)), [0, 0, 0]) == 2         # no match: the smallest cache
    sc.index.sink(2)(BlockStored(block_hashes=sc._hashes(prompt), parent_block_hash=None, token_ids=prompt,
                                 block_size=16))
    assert sc.choose(prompt, [0, 5, 3]) == 2                          # a tie in match: the less loaded


def test_a_routers_own_settings_override_the_module_defaults():
    """Scorer(overlap_weight=..., balance_abs=..., balance_rel=..., cache_threshold=...): the
    settings a router is started with (bench/picker_router.py's flags) decide, not the module's
    defaults: a low imbalance threshold moves a request off the replica holding its prefix, a
    high cache threshold ignores a short match, a high overlap weight keeps a hit."""
    from sarathi.measure import routing as R
    from scheduler_svc.kv_events import BlockStored

    prompt = list(range(100, 164))                      # 4 full blocks
    def scorer(routing, **kw):
        sc = R.Scorer(routing, 2, block_size=16, seed=0, **kw)
        sc.index.sink(0)(BlockStored(block_hashes=sc._hashes(prompt), parent_block_hash=None, token_ids=prompt,
                                     block_size=16))
        return sc
    assert scorer("cache-aware").choose(prompt, [3, 0]) == 0                   # defaults: 64 apart at least
    assert scorer("cache-aware", balance_abs=2).choose(prompt, [3, 0]) == 1
    assert scorer("cache-aware", balance_abs=2, balance_rel=4.0).choose(prompt, [3, 1]) == 0   # 3 < 4 x 1
    longer = prompt + list(range(500, 564))             # half of it cached on replica 0
    assert scorer("cache-aware").choose(longer, [0, 0]) == 0
    assert scorer("cache-aware", cache_threshold=0.6).choose(longer, [0, 0]) == 1   # the smaller cache
    assert scorer("kv-cost").choose(prompt + [9], pending_prefill=[0, 0], active_blocks=[8, 0]) == 1
    assert scorer("kv-cost", overlap_weight=4.0).choose(prompt + [9], pending_prefill=[0, 0],
                                                        active_blocks=[8, 0]) == 0


# -- a KV tier shared by the replicas ---------------------------------------------------------------
def _computed(bm, r) -> None:
    """As after the batch that computed all of r's prompt: its full blocks keyed."""
    r.num_computed_tokens = r.num_tokens
    bm.cache_computed_blocks(r)


def test_the_kv_tier_forgets_its_least_recently_used_block_first():
    tier = KVTier(2)
    tier.put(1)
    tier.put(2)
    assert tier.has(1)       # a use: 2 is now the oldest
    tier.put(3)
    assert not tier.has(2) and tier.has(1) and tier.has(3) and len(tier) == 2
    with pytest.raises(ValueError, match="at least 1 block"):
        KVTier(0)


def test_a_replica_loads_from_the_tier_what_another_computed_and_computes_the_rest():
    tier = KVTier(100)
    a, b = (TieredBlockManager(tier, 32, 4, 0, True) for _ in range(2))
    prompt = list(range(1, 19))          # 18 tokens: 4 full blocks, the last 2 tokens partial
    r = Request("a", prompt, SamplingParams(), 0.0)
    assert a.allocate(r) == 0 and a.take_loaded() == 0      # nothing anywhere yet
    _computed(a, r)
    assert len(tier) == 4                # written through as it was computed
    seen = []
    b.events = KVEventRecorder(4, sink=seen.append)
    s = Request("b", prompt + [40, 41], SamplingParams(), 0.0)
    assert b.allocate(s) == 16           # the 4 blocks come from the tier, not computed
    assert [len(ev.block_hashes) for ev in seen] == [4]                       # announced, as if computed
    assert seen[0].block_hashes == prefix_hashes(prompt, 4)[:4]              # under the events' own hashes
    assert s.num_computed_tokens == 16 and b.take_loaded() == 4 and b.take_loaded() == 0
    assert b.cached_prefix_tokens(Request("c", prompt, SamplingParams(), 0.0)) == 16   # now b's own
    t = Request("t", prompt, SamplingParams(), 0.0)
    assert b.allocate(t) == 16 and b.take_loaded() == 0       # a local hit loads nothing
    u = Request("u", list(range(1, 17)), SamplingParams(), 0.0)
    c = TieredBlockManager(tier, 32, 4, 0, True)
    assert c.allocate(u) == 12 and c.take_loaded() == 3       # the last token is always computed


def test_a_tier_load_stops_at_the_first_block_the_tier_lost():
    tier = KVTier(2)                     # holds the last 2 of the 4 blocks written
    a, b = (TieredBlockManager(tier, 32, 4, 0, True) for _ in range(2))
    prompt = list(range(1, 19))
    r = Request("a", prompt, SamplingParams(), 0.0)
    a.allocate(r)
    _computed(a, r)
    s = Request("b", prompt, SamplingParams(), 0.0)
    assert b.allocate(s) == 0 and b.take_loaded() == 0     # block 0 is gone: nothing after it counts


def test_a_tier_load_delays_the_batch_or_runs_beside_it():
    from sarathi.measure.simulate import SimulatedWorker
    from scheduler_svc.sim_executor import SimClock
    from shared.messages import Batch

    ends = {}
    for how in ("none", "sync", "overlap"):
        w = SimulatedWorker(lambda batch: 0.010, SimClock(), 16, 32000, kv_bytes_per_token=1000,
                            kv_link_gbs=1.0)
        if how != "none":
            w.loads = lambda: 1000          # 1000 blocks x 16 tokens x 1000 B over 1 GB/s: 16 ms
            w.load_overlap = how == "overlap"
        w.submit(Batch(0, []))
        ends[how] = w.next_done
    assert ends["none"] == pytest.approx(0.010)
    assert ends["sync"] == pytest.approx(0.026)       # the load, then the forward pass
    assert ends["overlap"] == pytest.approx(0.016)    # layer by layer beside it: the longer of the two


def test_a_shared_tier_gives_the_shared_queue_the_hits_its_pull_scatters():
    w = make_chat_workload(TRACE, 60, 1.0, ChatShape(system_len=128, turns=(4, 4), think_s=2.0), seed=2)
    _, plain = run_replicas(replicas(4), w, drain_s=60, routing="shared-queue")
    tier = KVTier(100_000)
    cfg = SchedulerConfig(token_budget=512, max_model_len=8192, enable_prefix_caching=True)
    reps = [Replica(COST, cfg, block_size=16, num_blocks=4096, max_model_len=8192, seed=i, kv_tier=tier,
                    kv_bytes_per_token=131072) for i in range(4)]
    rr, tiered = run_replicas(reps, w, drain_s=60, routing="shared-queue")
    assert all(r.finished for r in rr.records)
    assert tiered["kv_tier_loaded_blocks"] > 0 and tiered["kv_tier_load_s"] > 0
    assert tiered["prefix_hit_rate"] > plain["prefix_hit_rate"] + 0.2


def test_the_routing_bench_runs_a_routing_in_front_of_a_tier_beside_the_same_without(tmp_path):
    """bench.routing with a tier suffix: the tiered routing's probes report tier loads, the plain
    one's none; report lists both; an unknown suffix is refused."""
    import json

    from bench.routing import main

    main(["--replicas", "2", "--workloads", "chat", "--duration", "4", "--warmup", "4", "--num-requests", "60",
          "--qps-start", "4", "--resolution", "0.5", "--capacity-routings", "shared-queue,shared-queue+tier-lw",
          "--tier-blocks-per-replica", "10000", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "routing_chat_2r.json").read_text())
    plain, tiered = (res["capacity"][k]["probes"] for k in ("shared-queue", "shared-queue+tier-lw"))
    assert all("kv_tier_loaded_blocks" not in p["summary"] for p in plain)
    assert all(p["summary"]["kv_tier_loaded_blocks"] > 0 for p in tiered)
    assert res["at_common_qps"]["shared-queue+tier-lw"]["prefix_hit_rate"] > \
        res["at_common_qps"]["shared-queue"]["prefix_hit_rate"]
    main(["report", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert {"shared-queue", "shared-queue+tier-lw"} <= {r["routing"] for r in rows}
    with pytest.raises(ValueError, match="unknown tier suffix"):
        main(["probe", "--replicas", "2", "--workloads", "chat", "--duration", "4", "--qps-list", "4",
              "--routing", "mix+cache", "--out", str(tmp_path)])
