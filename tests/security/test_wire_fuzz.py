"""A property test of the worker's wire decoder: malformed messages (wrong types, ids out of range,
block tables too short, diffs that do not continue the mirror, KV sends of foreign blocks, unknown
ops, bytes that are not msgpack) never crash the worker; a refused batch changes nothing; every
batch the model runner does get keeps its block ids inside the cache and each KV send inside its
own request's table."""
from __future__ import annotations

import copy
import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.config import ModelInfo, cdiv
from shared.messages import Batch, BatchOutput, SeqChunk
from shared.sampling import SamplingParams
from shared.wire import BatchEncoder, pack
from worker_svc.service import WorkerServer

NUM_BLOCKS, BLOCK_SIZE, VOCAB, MAX_LEN = 16, 4, 100, 64
_names = itertools.count()


class Runner:
    """Records what it is asked to run; samples token 1."""

    model_info = ModelInfo("fuzz", max_model_len=MAX_LEN, vocab_size=VOCAB, eos_token_ids=[0],
                           block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)

    def __init__(self):
        self.batches: list[Batch] = []
        self.freed: list[str] = []

    def execute(self, batch: Batch) -> BatchOutput:
        self.batches.append(batch)
        return BatchOutput(batch.batch_id, {s.req_id: 1 for s in batch.seqs if s.sample}, {})

    def free(self, ids):
        self.freed.extend(ids)


class KvLinkStub:
    """Records the KV sends the worker makes (what would leave this worker)."""

    address = None

    def __init__(self):
        self.sent: list[tuple[list[int], str]] = []

    def send(self, src_blocks, dst_address, dst_blocks, timeout_s, req_id=""):
        self.sent.append((list(src_blocks), req_id))
        return 0.0, 0

    def close(self):
        pass


def primed_server() -> tuple[WorkerServer, Runner, KvLinkStub, str]:
    """A worker holding requests "a" (5 tokens, blocks 0-1) and "b" (3 tokens, block 2) of one
    epoch, as a real scheduler's encoder left them."""
    runner, link = Runner(), KvLinkStub()
    server = WorkerServer(runner, f"inproc://fuzz-{next(_names)}", kv_link=link, keys=None)
    enc = BatchEncoder()
    sp = SamplingParams(temperature=0.0)
    first = Batch(0, [SeqChunk("a", [1, 2, 3, 4, 5], 0, [0, 1], True, sp),
                      SeqChunk("b", [6, 7, 8], 0, [2], True, sp)])
    reply = server.handle_bytes(pack(enc.encode(first)))
    assert reply["ok"], reply
    runner.batches.clear()
    return server, runner, link, enc.epoch


garbage = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats() | st.text(max_size=6)
    | st.binary(max_size=6),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
    max_leaves=8)


def maybe(valid):
    return valid | garbage


req_ids = st.sampled_from(["a", "b", "c"]) | garbage
block_ids = st.lists(st.integers(-2, NUM_BLOCKS + 2), max_size=6)
tokens = st.lists(st.integers(-2, VOCAB + 2), max_size=6)
positions = st.integers(-2, MAX_LEN + 4)
sampling = st.just(SamplingParams(temperature=0.0).to_dict()) | st.dictionaries(
    st.sampled_from(["temperature", "top_p", "max_tokens", "seed", "bogus"]), garbage, max_size=3)
full_entry = st.fixed_dictionaries(
    {"r": req_ids, "t": maybe(tokens), "p": maybe(positions), "b": maybe(block_ids), "s": maybe(st.booleans()),
     "sp": sampling | garbage, "o": maybe(st.integers(-1, 4))}, optional={"h": maybe(tokens)})
diff_entry = st.fixed_dictionaries(
    {"r": req_ids, "n": maybe(st.integers(-1, 8)), "s": maybe(st.booleans())},
    optional={"t": maybe(tokens), "p": maybe(positions), "b+": maybe(block_ids), "b": maybe(block_ids),
              "o": maybe(st.integers(-1, 4))})
kv_send = st.fixed_dictionaries(
    {"req_id": req_ids, "src_blocks": maybe(block_ids), "dst_address": st.just("inproc://kv") | garbage,
     "dst_blocks": maybe(block_ids), "timeout_s": maybe(st.floats(-1, 20))})
batch_msg = st.fixed_dictionaries(
    {"op": st.just("batch"), "epoch": st.just("SAME") | garbage, "batch_id": maybe(st.integers(0, 9)),
     "seqs": maybe(st.lists(full_entry | diff_entry | garbage, max_size=3)),
     "freed": maybe(st.lists(req_ids, max_size=2))},
    optional={"kv_sends": maybe(st.lists(kv_send, max_size=2))})
message = batch_msg | st.fixed_dictionaries({"op": garbage}) | garbage


def check_runs(runner: Runner, link: KvLinkStub) -> None:
    """Every batch the runner got stays inside the cache; every KV send inside its own table."""
    for batch in runner.batches:
        tables = {}
        for s in batch.seqs:
            end = s.start_pos + len(s.token_ids)
            assert s.token_ids and 0 <= s.start_pos and end <= MAX_LEN
            assert all(type(t) is int and 0 <= t < VOCAB for t in s.token_ids)
            assert all(type(b) is int and 0 <= b < NUM_BLOCKS for b in s.block_table)
            assert len(s.block_table) >= cdiv(end, BLOCK_SIZE)
            tables[s.req_id] = set(s.block_table)
        for send in batch.kv_sends:
            assert send.req_id in tables and tables[send.req_id] >= set(send.src_blocks)
    for src, rid in link.sent:
        assert any(rid in {s.req_id for s in b.seqs} and set(src) <= set(
            next(s.block_table for s in b.seqs if s.req_id == rid)) for b in runner.batches)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(message | st.binary(max_size=24), min_size=1, max_size=3))
def test_malformed_messages_never_crash_the_worker_nor_touch_blocks_outside_a_table(msgs):
    server, runner, link, epoch = primed_server()
    try:
        for msg in msgs:
            if isinstance(msg, dict) and msg.get("epoch") == "SAME":
                msg = {**msg, "epoch": epoch}
            before = (server.decoder.epoch, copy.deepcopy(server.decoder.states), len(runner.batches),
                      len(runner.freed))
            try:
                payload = msg if isinstance(msg, bytes) else pack(msg)
            except (TypeError, ValueError, OverflowError):
                continue   # not expressible in msgpack: cannot reach the worker
            reply = server.handle_bytes(payload)
            assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool)
            if not reply["ok"]:
                assert reply["error"] in ("bad_request", "unknown_op", "unknown_request")
            if reply.get("error") in ("bad_request", "unknown_op"):
                after = (server.decoder.epoch, server.decoder.states, len(runner.batches), len(runner.freed))
                assert after == before, f"a refused message changed the worker: {msg!r}"
            check_runs(runner, link)
    finally:
        server.close()


def test_a_kv_send_of_another_requests_blocks_is_refused_and_nothing_leaves():
    """The attack the property covers, spelled out: a batch for "a" asks to export "b"'s block 2."""
    server, runner, link, epoch = primed_server()
    try:
        msg = {"op": "batch", "epoch": epoch, "batch_id": 1, "freed": [],
               "seqs": [{"r": "a", "n": 1, "s": True}],     # a's decode: a well-formed diff
               "kv_sends": [{"req_id": "a", "src_blocks": [2], "dst_address": "tcp://10.0.0.9:1",
                             "dst_blocks": [0], "timeout_s": 1.0}]}
        reply = server.handle_bytes(pack(msg))
        assert reply["error"] == "bad_request" and "not in that request's table" in reply["message"]
        assert runner.batches == [] and link.sent == []
        assert server.decoder.states["a"].tokens == [1, 2, 3, 4, 5, 1]   # as before the message
    finally:
        server.close()


def test_a_diff_whose_tokens_leave_a_hole_is_refused():
    server, runner, _, epoch = primed_server()
    try:
        msg = {"op": "batch", "epoch": epoch, "batch_id": 1, "freed": [],
               "seqs": [{"r": "a", "n": 1, "s": True, "t": [9], "p": 9}]}
        assert server.handle_bytes(pack(msg))["error"] == "bad_request"
        assert runner.batches == []
    finally:
        server.close()


class RoomyRunner(Runner):
    model_info = ModelInfo("fuzz", max_model_len=32, vocab_size=VOCAB, eos_token_ids=[0],
                           block_size=BLOCK_SIZE, num_blocks=64)


def scheduler_steps(ops):
    """Batches a scheduler could send for 3 requests: prompt chunks (sampling at random),
    decodes of the sampled token, recomputes from position 0 into other blocks (preemption), and
    frees. Each request i owns blocks 8i.. (or 32 + 8i.. after a recompute)."""
    sp, reqs = SamplingParams(temperature=0.0), {}
    for step, (kind, i, n) in enumerate(ops):
        rid = f"r{i}"
        r = reqs.setdefault(rid, {"toks": [], "c": 0, "outs": 0, "base": 8 * i})
        pending = len(r["toks"]) > r["c"]          # a sampled token not yet computed
        table = lambda end: [r["base"] + b for b in range(cdiv(end, BLOCK_SIZE))]  # noqa: E731
        if kind == "f":
            del reqs[rid]
            yield Batch(step, [], [rid])
            continue
        if kind == "r":
            length = len(r["toks"]) if pending else r["c"]
            if length == 0:
                continue
            r["base"] = 8 * i if r["base"] >= 32 else 32 + 8 * i
            chunk = SeqChunk(rid, r["toks"][:length], 0, table(length), pending, sp, r["outs"])
        elif pending:
            chunk = SeqChunk(rid, r["toks"][r["c"]:r["c"] + 1], r["c"], table(r["c"] + 1), True, sp, r["outs"])
        else:
            new = [(r["c"] + k) * 7 % (VOCAB - 1) + 1 for k in range(n)]
            r["toks"] += new
            chunk = SeqChunk(rid, new, r["c"], table(r["c"] + n), n % 2 == 0, sp, r["outs"])
        end = chunk.start_pos + len(chunk.token_ids)
        if end > 32 - 1:
            del reqs[rid]
            yield Batch(step, [], [rid])
            continue
        r["c"] = end
        if chunk.sample:
            r["toks"] = r["toks"][:end] + [1]
            r["outs"] += 1
        yield Batch(step, [chunk])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from("ccdrf"), st.integers(0, 2), st.integers(1, 6)), max_size=20))
def test_every_batch_a_scheduler_sends_is_accepted_and_decoded_as_sent(ops):
    """The checks refuse nothing the scheduler's encoder makes: full entries, diffs, and full
    entries again for requests the worker holds (a recompute)."""
    runner, enc = RoomyRunner(), BatchEncoder()
    server = WorkerServer(runner, f"inproc://fuzz-{next(_names)}", keys=None)
    try:
        for batch in scheduler_steps(ops):
            reply = server.handle_bytes(pack(enc.encode(batch)))
            assert reply["ok"], reply
            assert runner.batches[-1] == batch
            enc.on_output(BatchOutput.from_wire(reply))
    finally:
        server.close()


def test_a_full_entry_for_a_request_the_worker_holds_replaces_it():
    """The encoder sends a held request in full when its chunk cannot be a diff (tokens that differ
    from the worker's, or a gap): the checks judge such an entry on its own, not as a diff."""
    server, runner, _, epoch = primed_server()
    try:
        full = {"r": "a", "t": [9, 9], "p": 0, "b": [3], "s": False,
                "sp": SamplingParams(temperature=0.0).to_dict(), "o": 0}
        reply = server.handle_bytes(pack({"op": "batch", "epoch": epoch, "batch_id": 1, "freed": [],
                                          "seqs": [full]}))
        assert reply["ok"], reply
        assert runner.batches[-1].seqs[0].token_ids == [9, 9] and server.decoder.states["a"].block_table == [3]
    finally:
        server.close()
