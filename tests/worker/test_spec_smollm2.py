"""Speculative decoding on the real default model (SmolLM2-135M-Instruct GGUF, CPU backend),
through the real scheduler and model runner: greedy output with n-gram drafts is token for
token the output without them, drafts are accepted where the answer copies the prompt, and the
logits of the k + 1 positions of a decode with drafts are those of k + 1 single decodes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sarathi import LLM
from shared.messages import Batch, SeqChunk
from shared.sampling import SamplingParams
from tests.support.engine_helpers import use_threads

pytestmark = pytest.mark.slow

PASSAGE = ("The lighthouse keeper climbed the stairs every evening at six. He lit the lamp, wound "
           "the clockwork that turned the lens, and wrote the weather in a leather notebook. "
           "Ships passing the rocks at night saw the beam sweep the water every ten seconds.")
CONVERSATIONS = [
    [{"role": "user", "content": "Repeat this text exactly, word for word:\n\n" + PASSAGE}],
    [{"role": "user", "content": "Extract every time mentioned in this passage:\n\n" + PASSAGE}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "Fix the bug:\n\ndef add(a, b):\n    return a - b\n\nprint(add(2, 3))"}],
]


@pytest.fixture(scope="module", autouse=True)
def _threads():
    yield from use_threads(1)


def fixed_cost(engine, cost: float = 0.05):
    """Fix the measured cost of a draft: the tests check exactness with drafts running, and what
    a loaded test machine measures must not decide how many run."""
    spec = engine.scheduler.speculator
    spec.cost, spec.observe_batch = cost, lambda *args: None
    return engine


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=256, max_num_seqs=8)


def test_greedy_output_is_identical_with_and_without_drafts(llm):
    ids = [llm.tokenizer.encode_chat(c) for c in CONVERSATIONS]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    off = llm.make_engine(llm.scheduler_config)
    base = [o.output_token_ids for o in off.generate(ids, params)]
    on = fixed_cost(llm.make_engine(dataclasses.replace(llm.scheduler_config, speculative="ngram",
                                                        num_speculative_tokens=6)))
    # batch-1 decode, and all together (drafts beside other decodes and prefill chunks)
    alone = on.generate(ids[:1], params)[0].output_token_ids
    together = [o.output_token_ids for o in on.generate(ids, params)]
    assert alone == base[0]
    assert together == base
    st = on.stats()
    assert st["spec_accepted_tokens"] >= 25          # the copy prompt is mostly drafted
    assert st["spec_tokens_per_step"] > 1.3
    assert on.scheduler.block_manager.num_free_blocks == llm.model_info.num_blocks


def test_logits_of_a_decode_with_drafts_equal_single_decodes(llm):
    runner = llm.executor
    prompt = llm.tokenizer.encode_chat(CONVERSATIONS[0])
    table = list(range(-(-(len(prompt) + 8) // 16)))
    greedy = SamplingParams(temperature=0.0)
    runner.execute(Batch(0, [SeqChunk("a", prompt[:-1], 0, table, False, greedy)]))
    drafts = prompt[5:9]                               # any tokens: verification scores them
    got = runner.compute_logits(Batch(1, [SeqChunk("a", [prompt[-1]] + drafts, len(prompt) - 1,
                                                   table, True, greedy, 0, None, len(drafts))]))["a"]
    assert got.shape == (len(drafts) + 1, llm.model_info.vocab_size)
    for i, tok in enumerate([prompt[-1]] + drafts):    # the same positions one token at a time
        one = runner.compute_logits(Batch(2 + i, [SeqChunk("a", [tok], len(prompt) - 1 + i, table,
                                                           True, greedy, i)]))["a"]
        # each position runs as the decode at that position would (decode kernels, per-token
        # linear arithmetic): the same bits, so greedy verification is exact
        assert torch.equal(got[i], one)


def test_logprobs_and_sampling_with_drafts(llm):
    ids = [llm.tokenizer.encode_chat(CONVERSATIONS[0])]
    on = fixed_cost(llm.make_engine(dataclasses.replace(llm.scheduler_config, speculative="ngram",
                                                        num_speculative_tokens=4)))
    off = llm.make_engine(llm.scheduler_config)
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    a, b = off.generate(ids, params)[0], on.generate(ids, params)[0]
    assert b.output_token_ids == a.output_token_ids
    assert len(b.logprobs) == len(b.output_token_ids)   # accepted drafts have theirs too
    for (lp_a, top_a, _), (lp_b, top_b, _) in zip(a.logprobs, b.logprobs):
        assert abs(lp_a - lp_b) < 0.05 and top_a[0] == top_b[0]
    # unseeded sampling: rejection sampling runs, and copying is still mostly accepted
    before = on.stats()["spec_accepted_tokens"]
    out = on.generate(ids, SamplingParams(temperature=0.5, max_tokens=24))[0]
    assert len(out.output_token_ids) == 24 or out.finish_reason == "stop"
    assert on.stats()["spec_accepted_tokens"] > before


def test_structured_output_with_drafts_is_identical_and_drafts_are_accepted(llm):
    """A JSON-schema request speculates: each verified row is masked by what the grammar allows
    after the drafts before it, so greedy output is token for token the output without drafts
    (and valid JSON), and the values copied from the prompt are drafted and accepted."""
    import json

    from shared.constraints import grammar_for

    schema = {"type": "object", "additionalProperties": False, "required": ["keeper", "times", "notebook"],
              "properties": {"keeper": {"type": "string"}, "times": {"type": "array", "items": {"type": "string"}},
                             "notebook": {"type": "string"}}}
    ids = [llm.tokenizer.encode_chat([{"role": "user", "content": "Answer in JSON: who is the keeper, "
                                       "every time mentioned, and what he wrote in the notebook?\n\n" + PASSAGE}])]
    params = SamplingParams(temperature=0.0, max_tokens=64,
                            constraint=grammar_for("json_schema", schema, "response_format"))
    base = llm.make_engine(llm.scheduler_config).generate(ids, params)[0]
    on = fixed_cost(llm.make_engine(dataclasses.replace(llm.scheduler_config, speculative="ngram",
                                                        num_speculative_tokens=6)))
    got = on.generate(ids, params)[0]
    assert got.output_token_ids == base.output_token_ids
    if base.finish_reason == "stop":
        json.loads(llm.tokenizer.decode(base.output_token_ids))
    st = on.stats()
    assert st["spec_proposed_tokens"] > 0 and st["spec_accepted_tokens"] >= 5
