"""Constrained decoding and logit_bias on the worker's samplers (worker_svc.sampling.guided), with the real
SmolLM2 tokenizer and random logits: whatever the logits, a constrained request's tokens spell
text its grammar accepts; matchers are rebuilt from the token history after a preemption; the
mask is as wide as the logits; logprobs are those of the constrained distribution; the CUDA
device sampler's path (run on CPU tensors) keeps the same rules."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from shared.constraints import grammar_for
from shared.messages import SeqChunk
from shared.sampling import SamplingParams
from worker_svc.sampling import DeviceFirstSampler, Sampler
from worker_svc.sampling.guided import GuideMask, apply_token_bitmask, unpack_bitmask, unpack_bitmask_torch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 2,
                                  "items": {"type": "object", "additionalProperties": False,
                                            "required": ["kind"],
                                            "properties": {"kind": {"enum": ["cat", "dog"]}}}}}}
PROMPT = [1, 2, 3, 4]


def make_sampler(tokenizer, cls=Sampler, vocab=None):
    s = cls(seed=0, eos_token_ids=tokenizer.eos_token_ids)
    s.guides.bind(lambda: tokenizer, vocab or tokenizer.vocab_size)
    return s


def run(sampler, params: dict[str, SamplingParams], steps: int, vocab: int, seed: int = 0,
        preempt_at: int | None = None) -> dict[str, list[int]]:
    """Drive `sampler` like the model runner over `steps` steps of one batch of requests (random
    logits, a function of (seed, request, step) only); a request stops at EOS. At step
    preempt_at every request is freed and recomputed (one chunk with prior_token_ids)."""
    out: dict[str, list[int]] = {r: [] for r in params}
    done: set[str] = set()
    for step in range(steps):
        live = [r for r in params if r not in done]
        if not live:
            break
        if step == preempt_at:
            sampler.free(live)
        chunks = []
        for r in live:
            seq = PROMPT + out[r]
            if step == 0:
                chunks.append(SeqChunk(r, list(PROMPT), 0, [0], True, params[r], 0))
            elif step == preempt_at:     # recompute: everything but the last token, as prior
                chunks.append(SeqChunk(r, seq[-3:], len(seq) - 3, [0], True, params[r], len(out[r]),
                                       prior_token_ids=seq[:-3]))
            else:
                chunks.append(SeqChunk(r, seq[-1:], len(seq) - 1, [0], True, params[r], len(out[r])))
        sampler.observe(chunks)
        sampler.prepare(chunks)
        logits = torch.stack([torch.randn(vocab, generator=torch.Generator().manual_seed(
            seed * 100_000 + step * 100 + list(params).index(r))) * 4 for r in live])
        toks = sampler.sample_chunks(logits, chunks).tokens
        for r, t in zip(live, toks):
            out[r].append(t)
            if t in EOS:
                done.add(r)
    return out


EOS: set[int] = set()


@pytest.fixture(autouse=True)
def _eos(tokenizer):
    EOS.clear()
    EOS.update(tokenizer.eos_token_ids)


def text_of(tokenizer, ids):
    return tokenizer.decode([t for t in ids if t not in EOS])


def json_params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=200, constraint=grammar_for("json_schema", SCHEMA, "response_format"), **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_rows_match_their_schema_whatever_the_logits(tokenizer, temperature):
    sampler = make_sampler(tokenizer)
    params = {f"r{i}": json_params(temperature=temperature, seed=i) for i in range(3)}
    out = run(sampler, params, 120, tokenizer.vocab_size)
    for r, ids in out.items():
        assert ids[-1] in EOS, f"{r} did not finish: {text_of(tokenizer, ids)!r}"
        jsonschema.validate(json.loads(text_of(tokenizer, ids)), SCHEMA)


def test_an_unconstrained_row_draws_what_it_draws_alone(tokenizer):
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=50)
    alone = run(make_sampler(tokenizer), {"u": free}, 20, tokenizer.vocab_size, seed=3)
    mixed = run(make_sampler(tokenizer), {"u": free, "c": json_params(seed=1)}, 20, tokenizer.vocab_size, seed=3)
    assert mixed["u"] == alone["u"] and len(alone["u"]) == 20
    jsonschema.validate(json.loads(text_of(tokenizer, mixed["c"])), SCHEMA)


def test_a_preempted_request_rebuilds_its_matcher_from_the_token_history(tokenizer):
    params = {"a": json_params(temperature=1.0, seed=11)}
    straight = run(make_sampler(tokenizer), params, 120, tokenizer.vocab_size, seed=9)
    sampler = make_sampler(tokenizer)
    preempted = run(sampler, params, 120, tokenizer.vocab_size, seed=9, preempt_at=6)
    assert preempted == straight
    assert len(sampler.guides) == 1 and len(straight["a"]) > 6


def test_the_mask_is_as_wide_as_padded_logits_and_forbids_the_padding(tokenizer):
    vocab = tokenizer.vocab_size + 64
    sampler = make_sampler(tokenizer, vocab=vocab)
    p = SamplingParams(temperature=0.0, max_tokens=5, constraint=grammar_for("choice", ["yes", "no"], "choice"))
    chunk = SeqChunk("r", list(PROMPT), 0, [0], True, p, 0)
    sampler.observe([chunk])
    logits = torch.zeros(1, vocab)
    logits[0, -10:] = 100.0          # the padding columns would win if the mask missed them
    tok = sampler.sample_chunks(logits, [chunk]).tokens[0]
    assert tok < tokenizer.vocab_size and tokenizer.decode([tok]) in ("yes", "no", "y", "n")


def test_apply_token_bitmask_keeps_exactly_the_allowed_tokens():
    logits = torch.zeros(3, 70)
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 0b101               # tokens 0 and 2
    bitmask[1, 1] = -(1 << 31)          # token 63 (bit 31 of word 1)
    bitmask[1, 2] = 1 << 5              # token 69
    apply_token_bitmask(logits, GuideMask([0, 2], bitmask))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).all()
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [63, 69]


def test_the_accelerator_unpacking_equals_the_host_one():
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 7), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_bitmask(bitmask, "cpu"), unpack_bitmask_torch(bitmask))
    assert unpack_bitmask(bitmask, "cpu").shape == (3, 224)


def test_logprobs_are_those_of_the_constrained_distribution(tokenizer):
    sampler = make_sampler(tokenizer)
    p = SamplingParams(temperature=1.0, seed=0, max_tokens=5, logprobs=20,
                       constraint=grammar_for("choice", ["yes", "no"], "choice"))
    chunk = SeqChunk("r", list(PROMPT), 0, [0], True, p, 0)
    sampler.observe([chunk])
    logits = torch.randn(1, tokenizer.vocab_size, generator=torch.Generator().manual_seed(0))
    out = sampler.sample_chunks(logits, [chunk])
    chosen, ids, lps = out.logprobs[0]
    finite = [lp for lp in lps if lp > -1e30]
    assert 1 <= len(finite) < 20          # only the prefixes of "yes" and "no" have mass
    assert abs(sum(torch.tensor(finite).exp().tolist()) - 1.0) < 1e-4
    assert chosen in finite


@pytest.mark.parametrize("cls", [Sampler, DeviceFirstSampler])
def test_logit_bias_bans_and_forces_tokens(tokenizer, cls):
    sampler = make_sampler(tokenizer, cls)
    logits = torch.zeros(2, 100)
    logits[:, 7] = 5.0
    ban = SamplingParams(temperature=0.0, logit_bias=[(7, -100.0)])
    force = SamplingParams(temperature=1.0, seed=3, logit_bias=[(42, 100.0), (500, 3.0)])  # 500: past V
    chunks = [SeqChunk("a", [1], 0, [0], True, ban, 0), SeqChunk("b", [1], 0, [0], True, force, 0)]
    sampler.observe(chunks)
    tokens = sampler.sample_chunks(logits, chunks).tokens
    assert tokens[0] != 7 and tokens[1] == 42


def test_the_device_sampler_path_keeps_the_constraint(tokenizer):
    sampler = make_sampler(tokenizer, DeviceFirstSampler)
    params = {f"r{i}": json_params(temperature=1.0, seed=i) for i in range(2)}
    assert all(sampler.device_sampler.supports(p) for p in params.values())
    out = run(sampler, params, 120, tokenizer.vocab_size)
    for ids in out.values():
        jsonschema.validate(json.loads(text_of(tokenizer, ids)), SCHEMA)


def test_draft_masks_follow_the_grammar_through_the_drafts(tokenizer):
    """The masks of a constrained chunk with drafts: row 0 is the mask decoding without drafts
    applies now; row i + 1 is the mask after drafts[:i + 1] (each valid draft allowed in its
    own row); a draft the grammar forbids is forbidden in its row and every row after it allows
    everything; the matcher is where it was afterwards."""
    from worker_svc.sampling.guided import unpack_bitmask

    sampler = make_sampler(tokenizer)
    p = SamplingParams(temperature=0.0, max_tokens=50, constraint=grammar_for("regex", "(abc|abd)+x", "regex"))
    enc = [tokenizer.encode(t, add_special_tokens=False) for t in ("abc", "abd", "x")]
    generated = enc[0]
    first = SeqChunk("r", list(PROMPT), 0, [0], False, p, 0)
    sampler.observe([first])
    seq = PROMPT + generated
    plain = SeqChunk("r", seq[-1:], len(seq) - 1, [0], True, p, len(generated))
    sampler.observe([plain])
    now = sampler.guides.masks([plain]).bitmask[0]
    bad = tokenizer.encode("zz", add_special_tokens=False)[0]
    drafts = enc[1] + [bad] + enc[2]
    chunk = SeqChunk("r", seq[-1:] + drafts, len(seq) - 1, [0], True, p, len(generated),
                     num_draft_tokens=len(drafts))
    sampler.observe([chunk])
    rows = sampler.guides.draft_masks(chunk, drafts)
    allowed = unpack_bitmask(rows, "cpu")
    assert rows.shape[0] == len(drafts) + 1 and torch.equal(rows[0], now)
    for i, d in enumerate(enc[1]):
        assert allowed[i, d], f"draft {i} ({d}) should be allowed after the ones before it"
    at_bad = len(enc[1])
    assert not allowed[at_bad, bad]
    assert bool((rows[at_bad + 1:] == -1).all())
    again = SeqChunk("r", seq[-1:], len(seq) - 1, [0], True, p, len(generated))
    sampler.observe([again])
    assert torch.equal(sampler.guides.masks([again]).bitmask[0], now)
