"""Draft tokens on the scheduler <-> worker wire: a chunk with drafts round-trips exactly, the
mirrors record accepted drafts like sampled tokens (the next decode is a bare diff), and a rank
that does not sample, which cannot know what was accepted, gets the next chunk in full."""
from __future__ import annotations

from shared.messages import Batch, BatchOutput, SeqChunk
from shared.sampling import SamplingParams
from shared.wire import BatchDecoder, BatchEncoder, pack, unpack

G = SamplingParams(temperature=0.0)


def roundtrip(enc, dec, batch):
    msg = unpack(pack(enc.encode(batch)))
    got = dec.decode(msg)
    assert got == batch
    return msg


def test_drafts_round_trip_and_accepted_tokens_keep_the_next_diff_bare():
    enc, dec = BatchEncoder(), BatchDecoder()
    dec.new_epoch(enc.epoch)
    prompt = [5, 6, 7, 8, 9]
    roundtrip(enc, dec, Batch(0, [SeqChunk("r", prompt, 0, [0, 1], True, G)]))
    out = BatchOutput(0, {"r": 6})
    enc.on_output(out)
    dec.on_output(out)
    # decode 6 with drafts 7 8 9 at positions 5..8
    msg = roundtrip(enc, dec, Batch(1, [SeqChunk("r", [6, 7, 8, 9], 5, [0, 1, 2], True, G, 1,
                                                 num_draft_tokens=3)]))
    entry = msg["seqs"][0]
    assert "sp" not in entry and entry["t"] == [7, 8, 9] and entry["k"] == 3
    out = BatchOutput(1, {"r": 4}, accepted={"r": [7, 8]})    # 9 rejected, then 4 sampled
    enc.on_output(out)
    dec.on_output(out)
    # the next decode starts after the accepted drafts: 4 at position 8, known to the worker
    msg = roundtrip(enc, dec, Batch(2, [SeqChunk("r", [4], 8, [0, 1, 2], True, G, 4)]))
    assert msg["seqs"][0] == {"r": "r", "n": 1, "s": True}
    assert dec.states["r"].tokens == prompt + [6, 7, 8, 4]


def test_a_rank_that_does_not_sample_gets_the_next_chunk_in_full():
    enc, dec = BatchEncoder(), BatchDecoder()
    dec.new_epoch(enc.epoch)
    roundtrip(enc, dec, Batch(0, [SeqChunk("r", [5, 6, 7], 0, [0], True, G)]))
    for side in (enc, dec):       # this rank's own output: nothing sampled
        side.on_output(BatchOutput(0, {}))
    # the scheduler knows the token (6); this rank's mirror does not: a diff carries it
    roundtrip(enc, dec, Batch(1, [SeqChunk("r", [6, 7, 8], 3, [0, 1], True, G, 1, num_draft_tokens=2)]))
    for side in (enc, dec):
        side.on_output(BatchOutput(1, {}))
    # 7 8 accepted elsewhere, 1 sampled: the chunk starts past what this rank knows
    msg = roundtrip(enc, dec, Batch(2, [SeqChunk("r", [1], 6, [0, 1], True, G, 4)]))
    assert "sp" in msg["seqs"][0]
    # and a batch output with accepted drafts survives the wire
    out = BatchOutput(3, {"r": 1}, accepted={"r": [7]}, accepted_logprobs={"r": [[-0.1, [7], [-0.1]]]})
    assert BatchOutput.from_wire(unpack(pack(out.to_wire()))) == out
