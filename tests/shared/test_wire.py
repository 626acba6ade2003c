"""The worker wire protocol: full data once, diffs after, and the worker rebuilds exactly the
scheduler's Batch. Torch-free."""
from __future__ import annotations

import random

import pytest

from shared.messages import Batch, BatchOutput, SeqChunk
from shared.sampling import SamplingParams
from shared.wire import BatchDecoder, BatchEncoder, UnknownRequestError, pack, unpack

BLOCK = 4


def chunk(req, toks, start, sample=False, out=0, table=None, seed=None):
    table = table if table is not None else list(range(100, 100 + (start + len(toks) + BLOCK - 1) // BLOCK))
    return SeqChunk(req, toks, start, table, sample, SamplingParams(temperature=0.0, seed=seed), out)


def roundtrip(enc, dec, batch, sampled=None):
    """Send `batch` through the wire; feed both sides the same output; return (rebuilt, msg)."""
    msg = unpack(pack(enc.encode(batch)))
    rebuilt = dec.decode(msg)
    out = BatchOutput(batch.batch_id, sampled or {})
    enc.on_output(out)
    dec.on_output(out)
    return rebuilt, msg


def test_first_chunk_is_sent_in_full():
    enc, dec = BatchEncoder(), BatchDecoder()
    b = Batch(0, [chunk("a", [1, 2, 3], 0, seed=7)])
    rebuilt, msg = roundtrip(enc, dec, b)
    assert rebuilt == b
    assert "sp" in msg["seqs"][0]


def test_decode_after_prefill_sends_no_tokens_and_no_sampling():
    enc, dec = BatchEncoder(), BatchDecoder()
    roundtrip(enc, dec, Batch(0, [chunk("a", [1, 2, 3], 0, sample=True)]), {"a": 42})
    b = Batch(1, [chunk("a", [42], 3, sample=True, out=1)])
    rebuilt, msg = roundtrip(enc, dec, b, {"a": 43})
    assert rebuilt == b
    assert msg["seqs"][0] == {"r": "a", "n": 1, "s": True}


def test_next_prefill_chunk_sends_only_its_tokens_and_new_blocks():
    enc, dec = BatchEncoder(), BatchDecoder()
    roundtrip(enc, dec, Batch(0, [chunk("a", [1, 2, 3, 4], 0)]))
    b = Batch(1, [chunk("a", [5, 6], 4, sample=True)])
    rebuilt, msg = roundtrip(enc, dec, b)
    assert rebuilt == b
    assert msg["seqs"][0] == {"r": "a", "n": 2, "s": True, "t": [5, 6], "b+": [101]}


def test_freed_request_is_forgotten_and_resent_in_full():
    enc, dec = BatchEncoder(), BatchDecoder()
    roundtrip(enc, dec, Batch(0, [chunk("a", [1, 2], 0, sample=True)]), {"a": 9})
    b = Batch(1, [chunk("a", [1, 2, 9], 0, table=[7])], freed_req_ids=["a"])  # preempted, recomputed
    rebuilt, msg = roundtrip(enc, dec, b)
    assert rebuilt == b
    assert "sp" in msg["seqs"][0]


def test_prefix_cached_request_starts_past_zero():
    enc, dec = BatchEncoder(), BatchDecoder()
    b0 = Batch(0, [chunk("a", [9, 10], 8, sample=True)])
    b1 = Batch(1, [chunk("a", [77], 10, sample=True, out=1)])
    assert roundtrip(enc, dec, b0, {"a": 77})[0] == b0
    assert roundtrip(enc, dec, b1)[0] == b1


def test_diff_for_unknown_request_is_an_error_that_changes_nothing():
    enc, dec = BatchEncoder(), BatchDecoder()
    roundtrip(enc, dec, Batch(0, [chunk("a", [1, 2], 0)]))
    fresh = BatchDecoder()  # e.g. the worker restarted and lost its mirror
    msg = unpack(pack(enc.encode(Batch(1, [chunk("a", [3], 2)]))))
    with pytest.raises(UnknownRequestError):
        fresh.decode(msg)
    assert fresh.states == {}


def test_new_epoch_drops_every_mirror_on_the_worker():
    enc, dec = BatchEncoder(), BatchDecoder()
    dec.new_epoch(enc.epoch)
    roundtrip(enc, dec, Batch(0, [chunk("a", [1, 2], 0)]))
    enc.reset()
    assert dec.new_epoch(enc.epoch) == ["a"]
    b = Batch(1, [chunk("a", [3], 2, table=[100])])
    assert roundtrip(enc, dec, b)[0] == b


def random_schedule(rng: random.Random, steps: int):
    """A toy scheduler: chunked prefills, decodes, preemption (recompute from 0), replaced block
    tables and prefix-cache starts. Yields (Batch, sampled) pairs."""
    reqs: dict[str, dict] = {}
    freed: list[str] = []
    for step in range(steps):
        if rng.random() < 0.4:
            rid = f"r{step}"
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
            start = rng.choice([0, 0, BLOCK * rng.randint(0, len(prompt) // BLOCK)])
            reqs[rid] = {"toks": prompt, "plen": len(prompt), "done": min(start, len(prompt) - 1),
                         "out": 0, "blocks": []}
        seqs, sampled = [], {}
        for rid, r in list(reqs.items()):
            if rng.random() < 0.05:  # preempted or finished
                freed.append(rid)
                if rng.random() < 0.5:
                    reqs[rid].update(done=0, blocks=[])
                else:
                    del reqs[rid]
                continue
            n = min(rng.randint(1, 6), len(r["toks"]) - r["done"])
            start = r["done"]
            need = (start + n + BLOCK - 1) // BLOCK
            if rng.random() < 0.05:
                r["blocks"] = [rng.randrange(10_000) for _ in range(need)]  # a whole new table
            while len(r["blocks"]) < need:
                r["blocks"].append(rng.randrange(10_000))
            sample = start + n == len(r["toks"])
            seqs.append(SeqChunk(rid, r["toks"][start:start + n], start, list(r["blocks"]), sample,
                                 SamplingParams(temperature=0.0, max_tokens=50), r["out"]))
            r["done"] += n
            if sample:
                tok = rng.randrange(1000)
                sampled[rid] = tok
                r["toks"].append(tok)
                r["out"] += 1
        yield Batch(step, seqs, freed), sampled
        freed = []


@pytest.mark.parametrize("seed", range(20))
def test_random_schedules_round_trip_exactly(seed):
    enc, dec = BatchEncoder(), BatchDecoder()
    full_bytes = diff_bytes = 0
    for batch, sampled in random_schedule(random.Random(seed), 120):
        rebuilt, msg = roundtrip(enc, dec, batch, sampled)
        assert rebuilt == batch
        diff_bytes += len(pack(msg))
        full_bytes += len(pack(batch.to_wire()))
    assert diff_bytes < full_bytes
