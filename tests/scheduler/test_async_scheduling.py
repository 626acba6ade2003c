"""Async scheduling: batch n + 1 is planned while batch n runs; outputs do not change.

The SimExecutor derives every token from the context it reads back through the block tables, so
a decode planned ahead that computed the wrong token, at the wrong position or in a block it does
not own changes the output or raises. Every comparison is against the same run without async
scheduling.
"""
from __future__ import annotations

import random

import pytest

from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.sim_executor import SimExecutor, sim_engine
from shared.constraints import grammar_for
from shared.messages import PENDING_TOKEN, Batch, SeqChunk, fill_pending
from shared.sampling import SamplingParams

POLICIES = ["sarathi", "vllm", "orca", "faster_transformer", "chunked_only", "hybrid_only"]


class Recording(SimExecutor):
    """A SimExecutor that keeps every batch it ran (token ids as sent)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches: list[Batch] = []

    def execute(self, batch):
        self.batches.append(Batch(batch.batch_id, [SeqChunk(**vars(s)) for s in batch.seqs],
                                  list(batch.freed_req_ids)))
        return super().execute(batch)


def _engine(asy: bool, policy: str = "sarathi", **kw) -> EngineLoop:
    loop = sim_engine(policy, async_scheduling=asy, **kw)
    rec = Recording(loop.executor.block_size, loop.executor.vocab_size,
                    scripts=loop.executor.scripts)
    loop.executor = rec
    loop._pipe.executor = rec
    return loop


def _workload(seed: int = 1, n: int = 40):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randrange(1, 200))] for _ in range(n)]
    sps = [SamplingParams(max_tokens=rng.randrange(1, 60), seed=i) for i in range(n)]
    return prompts, sps


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("num_blocks,prefix_caching", [(1024, False), (40, False), (60, True)])
def test_outputs_equal_the_synchronous_loop_under_every_policy(policy, num_blocks, prefix_caching):
    """Plenty of memory, memory so short that decodes preempt each other, and shared prefixes
    kept in the cache: the same tokens for every request, and decodes really were planned
    ahead (PENDING_TOKEN on the way to the executor)."""
    prompts, sps = _workload()
    got = {}
    for asy in (False, True):
        loop = _engine(asy, policy, token_budget=64, num_blocks=num_blocks,
                       enable_prefix_caching=prefix_caching)
        got[asy] = [o.output_token_ids for o in loop.generate(prompts, sps)]
        ahead = sum(s.is_ahead for b in loop.executor.batches for s in b.seqs)
        assert (ahead > 0) == asy
    assert got[True] == got[False]


def test_a_request_that_stops_drops_the_token_planned_after_it():
    """A scripted EOS at output 3: the request ends there with reason stop; the decode planned
    ahead of it ran, and its token is not emitted."""
    loop = _engine(True, block_size=4, num_blocks=64, max_model_len=64)
    loop.executor.scripts["gen-0"] = [5, 6, 7, 0]
    events = []
    out = loop.generate([[1, 2, 3]], SamplingParams(max_tokens=20), on_event=events.append)[0]
    assert out.output_token_ids == [5, 6, 7, 0] and out.finish_reason == "stop"
    assert [e.index for e in events] == [0, 1, 2, 3]
    ran = [s.output_index for b in loop.executor.batches for s in b.seqs if s.req_id == "gen-0"]
    assert ran[-1] == 4            # the decode planned ahead of the EOS ran ...
    assert not loop.scheduler.requests and loop.scheduler.block_manager.num_used_blocks == 0


def test_a_request_at_its_last_token_gets_no_decode_planned_after_it():
    """max_tokens (and the context length) are known ahead: no decode is planned past them."""
    loop = _engine(True, block_size=4, num_blocks=64, max_model_len=64)
    outs = loop.generate([[1, 2, 3], [4] * 58], [SamplingParams(max_tokens=5, ignore_eos=True),
                                                 SamplingParams(max_tokens=6, ignore_eos=True)])
    assert [len(o.output_token_ids) for o in outs] == [5, 6]
    assert outs[1].finish_reason == "length"      # 58 + 6 = 64 = max_model_len
    for req_id, last in (("gen-0", 4), ("gen-1", 5)):
        ran = [s.output_index for b in loop.executor.batches for s in b.seqs if s.req_id == req_id]
        assert max(ran) == last


def test_an_abort_is_not_outrun_by_decodes_planned_ahead():
    """The request is in flight at every step boundary; its abort still takes effect within two
    batches, and nothing is emitted after the abort event."""
    loop = _engine(True, block_size=4, num_blocks=64, max_model_len=256)
    loop.add_request("r", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
    loop.add_request("s", [4, 5], SamplingParams(max_tokens=30, ignore_eos=True))
    events = []
    for _ in range(5):
        events += loop.step()
    assert loop.scheduler.requests["r"].in_flight      # planned ahead at every boundary
    loop.abort("r")
    for _ in range(3):
        events += loop.step()
    r_events = [e for e in events if e.req_id == "r"]
    assert r_events[-1].finish_reason == "abort"
    assert "r" not in loop.scheduler.requests
    loop.run_until_done(on_event=events.append)
    assert [e.finish_reason for e in events if e.req_id == "r"][-1] == "abort"
    assert sum(1 for e in events if e.req_id == "s" and e.token_id is not None) == 30


def test_a_request_with_penalties_makes_the_loop_plan_one_batch_at_a_time():
    """Penalties (and grammars) need each token on the host: while such a request is in flight
    no batch is planned ahead, so it still gets a token every batch; both requests' tokens are
    those of the synchronous loop."""
    def run(asy):
        loop = _engine(asy, block_size=4, num_blocks=64, max_model_len=256)
        events = []
        loop.add_request("plain", [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))
        for _ in range(4):
            events += loop.step()
        loop.add_request("pen", [7, 8], SamplingParams(max_tokens=10, ignore_eos=True,
                                                      presence_penalty=0.5))
        loop.run_until_done(on_event=events.append)
        tokens = {r: [e.token_id for e in events if e.req_id == r] for r in ("plain", "pen")}
        return loop, tokens
    loop, tokens = run(True)
    assert tokens == run(False)[1]
    batches = loop.executor.batches
    pen = [i for i, b in enumerate(batches) if any(s.req_id == "pen" for s in b.seqs)]
    assert any(s.is_ahead for b in batches[:pen[0]] for s in b.seqs)
    # from its first chunk on, "pen" is in every batch until its last, and none after its first
    # is planned ahead (its first may be: it was admitted by a batch planned ahead)
    assert pen == list(range(pen[0], pen[0] + 10))
    assert not any(s.is_ahead for b in batches[pen[0] + 1:pen[-1] + 1] for s in b.seqs)


def test_grammar_sampling_is_not_planned_ahead():
    sched = _engine(True).scheduler
    assert not sched._ahead_capable(SamplingParams(constraint=grammar_for("regex", "a+", "regex")))
    assert not sched._ahead_capable(SamplingParams(repetition_penalty=1.2))
    assert sched._ahead_capable(SamplingParams(temperature=0.7, top_p=0.9, seed=3, logprobs=2))


def test_iteration_times_count_from_the_previous_batch_end():
    """A batch planned ahead waits for the one before it; the time it is charged (what the
    adaptive budget and the metrics learn from) starts when that one ended."""
    from scheduler_svc.sim_executor import linear_cost_model
    seen = {}
    for asy in (False, True):
        loop = sim_engine("sarathi", async_scheduling=asy, block_size=4, num_blocks=256,
                          cost_model=linear_cost_model(0.01, 0.0, 0.0))
        observed = []
        loop.scheduler.policy.observe = lambda n, s, now, o=observed: o.append(round(s, 9))
        loop.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
        seen[asy] = observed
    assert set(seen[False]) == {0.01}
    assert set(seen[True]) == {0.01}


def test_speculation_drafts_where_budget_is_left_and_planning_ahead_takes_over_between():
    """Both on: while prompts wait or fill the budget (no room for drafts) the loop plans ahead;
    once only decodes are left and budget is over, speculation drafts and the loop plans one
    batch at a time (a decode with drafts must be verified before its next step). Drafts are
    judged as a greedy model would (accepted iff they are the next tokens), so every output
    equals the run without either; both occurred."""
    cycle = [5, 6, 7, 8, 9]
    prompts = ([[1, 2, 3] + cycle * 3 + [i + 20] for i in range(4)]
               + [[30 + i] * (40 + 9 * i) for i in range(12)])
    sps = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 4 + \
          [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)] * 12
    scripts = {f"gen-{i}": cycle * 6 for i in range(4)}     # answers that repeat the prompt

    def run(asy, spec):
        loop = _engine(asy, token_budget=64, speculative=spec)
        loop.executor.scripts.update(scripts)
        if spec != "off":    # the untimed sim measures no cost: what a draft is taken to cost
            loop.scheduler.speculator.default_cost = 0.1
        return loop, [o.output_token_ids for o in loop.generate(prompts, sps)]
    want = run(False, "off")[1]
    for asy in (False, True):
        loop, got = run(asy, "ngram")
        assert got == want
        seqs = [s for b in loop.executor.batches for s in b.seqs]
        stats = loop.scheduler.stats()
        assert sum(s.num_draft_tokens for s in seqs) > 0 and stats["spec_accepted_tokens"] > 0, stats
        assert any(s.is_ahead for s in seqs) == asy
        # no batch holds a draft-carrying decode of a request planned ahead in the same batch
        assert not any(s.is_ahead and s.num_draft_tokens for s in seqs)


def test_async_scheduling_refuses_pipeline_stages():
    loop = sim_engine(async_scheduling=True)
    with pytest.raises(ValueError, match="pipeline"):
        EngineLoop(loop.scheduler, loop.executor, depth=2)
    with pytest.raises(ValueError, match="async_scheduling"):
        sim_engine().scheduler.schedule(ahead=True)


def test_fill_pending_takes_the_last_batch_token_or_names_the_request():
    sp = SamplingParams()
    batch = Batch(3, [SeqChunk("a", [PENDING_TOKEN], 5, [0], True, sp, 2),
                      SeqChunk("b", [9, 10], 0, [1], True, sp, 0)], [])
    filled = fill_pending(batch, {"a": 42, "x": 1})
    assert [s.token_ids for s in filled.seqs] == [[42], [9, 10]]
    assert batch.seqs[0].token_ids == [PENDING_TOKEN]            # the given batch is untouched
    assert fill_pending(filled, {}) is filled                    # nothing pending: no copy
    with pytest.raises(ValueError, match="request a"):
        fill_pending(batch, {"b": 1})


class WireExecutor:
    """The remote path without sockets: every batch is encoded by the scheduler's BatchEncoder,
    packed, checked and decoded by the worker's BatchDecoder, run there, and the output recorded
    on both sides in the order the real ones are (the worker before replying, the scheduler's
    encoder when it collects, after it has encoded the batch planned ahead)."""

    def __init__(self, block_size: int):
        from shared.wire import BatchDecoder, BatchEncoder
        self.enc, self.dec = BatchEncoder(), BatchDecoder()
        self.worker = Recording(block_size)
        self.queue, self.messages = [], []

    def submit(self, batch):
        from shared.wire import pack
        self.queue.append((batch, pack(self.enc.encode(batch))))

    def collect(self):
        from shared.wire import unpack
        from worker_svc.wire_check import WireLimits, check_batch_message
        batch, data = self.queue.pop(0)
        msg = unpack(data)
        self.messages.append(msg)
        mirror = self.dec.states if msg["epoch"] == self.dec.epoch else {}
        check_batch_message(msg, mirror, WireLimits(2048, self.worker.block_size, 1024, 32000))
        self.dec.new_epoch(msg["epoch"])
        out = self.worker.execute(self.dec.decode(msg))
        self.dec.on_output(out)
        self.enc.on_output(out)
        return batch, out


def test_over_the_wire_a_decode_planned_ahead_travels_without_its_token():
    """The diff of a decode planned ahead carries no token ("a": 1); the worker's mirror fills
    it in with the token it sampled itself, so the runner never sees PENDING_TOKEN, and the
    mirrors stay aligned (later diffs carry no tokens either) with the same outputs."""
    prompts, sps = _workload(seed=2, n=24)
    sync = _engine(False, token_budget=64, num_blocks=80)
    want = [o.output_token_ids for o in sync.generate(prompts, sps)]
    loop = sim_engine("sarathi", token_budget=64, num_blocks=80, async_scheduling=True)
    wire = WireExecutor(loop.executor.block_size)
    loop.executor = loop._pipe = wire
    assert [o.output_token_ids for o in loop.generate(prompts, sps)] == want
    entries = [d for m in wire.messages for d in m["seqs"]]
    ahead = [d for d in entries if d.get("a")]
    assert ahead and all("t" not in d and "sp" not in d and d["n"] == 1 for d in ahead)
    assert not any(PENDING_TOKEN in s.token_ids for b in wire.worker.batches for s in b.seqs)
    decodes = [d for m, b in zip(wire.messages, wire.worker.batches)
               for d, s in zip(m["seqs"], b.seqs) if s.is_decode and "sp" not in d]
    assert len(decodes) > len(ahead)
    assert all("t" not in d for d in decodes)   # a decode's token is always the worker's own


def test_the_worker_refuses_a_decode_planned_ahead_that_carries_tokens_or_leaves_a_hole():
    from shared.wire import SeqState
    from worker_svc.wire_check import WireCheckError, WireLimits, check_batch_message
    st = SeqState(SamplingParams(), base=0, tokens=[1, 2, 3], block_table=[0], next_pos=3,
                  output_index=1)
    limits = WireLimits(64, 4, 16, 100)

    def msg(**d):
        return {"op": "batch", "epoch": "e", "batch_id": 1, "freed": [],
                "seqs": [{"r": "x", "n": 1, "s": True, "a": 1, **d}]}
    check_batch_message(msg(), {"x": st}, limits)               # right after the known tokens
    check_batch_message(msg(p=2), {"x": st}, limits)            # a token the worker holds
    with pytest.raises(WireCheckError, match="planned ahead"):
        check_batch_message(msg(t=[5]), {"x": st}, limits)
    with pytest.raises(WireCheckError, match="planned ahead"):
        check_batch_message(msg(p=5, **{"b+": [1]}), {"x": st}, limits)


def test_disaggregation_refuses_async_scheduling():
    from scheduler_svc.pools import make_pool
    from shared.config import SchedulerConfig
    with pytest.raises(ValueError, match="disaggregation"):
        make_pool("p0", "prefill", object(), SchedulerConfig(async_scheduling=True), None)


def test_batches_say_whether_the_scheduler_plans_ahead_and_the_wire_keeps_it():
    """A worker holds a launched batch only for a scheduler that plans ahead (Batch.ahead)."""
    from shared.wire import BatchDecoder, BatchEncoder, pack, unpack
    for asy in (False, True):
        loop = sim_engine(async_scheduling=asy)
        loop.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
        batch = loop.scheduler.schedule()
        assert batch.ahead is asy
        assert Batch.from_wire(unpack(pack(batch.to_wire()))).ahead is asy
        assert BatchDecoder().decode(unpack(pack(BatchEncoder().encode(batch)))).ahead is asy


def test_a_worker_lost_with_a_batch_planned_ahead_loses_no_token():
    """The worker dies with two batches in flight (one planned ahead, its decodes' tokens still
    pending): the engine's fault rules preempt every request, which is recomputed with the
    tokens it had once the worker answers again; every token comes once, as without the loss."""
    from scheduler_svc.remote_executor import WorkerLostError
    from tests.support.sim_pools import LosableSim

    prompts, sps = _workload(seed=4, n=12)

    def engine(asy):
        loop = sim_engine("sarathi", token_budget=32, num_blocks=256, async_scheduling=asy)
        ex = LosableSim(loop.executor.block_size, loop.executor.vocab_size)
        loop.executor = loop._pipe.executor = ex
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            loop.add_request(f"r{i}", p, sp)
        return loop, ex

    def tokens(events):
        out = {}
        for e in events:
            if e.token_id is not None:
                assert e.index == len(out.setdefault(e.req_id, [])), e
                out[e.req_id].append(e.token_id)
        return out

    ref, _ = engine(False)
    want = []
    ref.run_until_done(on_event=want.append)
    loop, ex = engine(True)
    events = []
    for _ in range(6):
        events += loop.step()
    assert len(loop.in_flight) == 1        # the batch planned ahead
    ex.lose()
    with pytest.raises(WorkerLostError):
        loop.step()
    events += loop.recover(WorkerLostError("simulated worker death"))
    assert not loop.in_flight and not loop.worker_up
    ex.down = False
    events += loop.wait_for_worker()
    assert loop.worker_up
    loop.run_until_done(on_event=events.append)
    assert tokens(events) == tokens(want)
    assert loop.scheduler.block_manager.num_used_blocks == 0
