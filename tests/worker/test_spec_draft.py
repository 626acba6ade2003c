"""The draft-model proposer (--speculative draft): a tiny random model with the default model's
vocabulary proves the mechanics (its drafts are verified by SmolLM2 and the greedy output is
unchanged), the default model as its own draft has its drafts accepted, and a draft model with
another vocabulary is refused when the scheduler is built, through the CLI too."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sarathi import LLM
from sarathi.cli import main
from sarathi.cli_config import enable_draft_model
from shared.model_source import resolve_model
from shared.sampling import SamplingParams
from tests.support.engine_helpers import use_threads
from tests.worker.test_spec_smollm2 import fixed_cost

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _threads():
    yield from use_threads(1)


def tiny_llama(path, vocab_size: int, eos: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               max_position_embeddings=2048, eos_token_id=eos, bos_token_id=1,
                               tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def llm():
    enable_draft_model()
    return LLM(num_blocks=128)


def test_draft_models_propose_and_the_output_is_unchanged(llm, tmp_path_factory):
    ids = [llm.tokenizer.encode_chat([{"role": "user", "content": "Name three rivers in Europe."}])]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    base = llm.make_engine(llm.scheduler_config).generate(ids, params)[0].output_token_ids
    tiny = tiny_llama(tmp_path_factory.mktemp("draft") / "tiny", llm.model_info.vocab_size,
                      llm.model_info.eos_token_ids[0])
    for draft, min_rate in ((tiny, 0.0), (str(resolve_model(None).path), 0.8)):
        cfg = dataclasses.replace(llm.scheduler_config, speculative="draft", draft_model=draft,
                                  num_speculative_tokens=3)
        engine = fixed_cost(llm.make_engine(cfg))
        out = engine.generate(ids, params)[0].output_token_ids
        st = engine.stats()
        assert out == base
        assert st["spec_proposed_tokens"] > 0
        assert st["spec_acceptance_rate"] >= min_rate, (draft, st)
        prop = engine.scheduler.speculator.proposer
        assert len(prop.free_blocks) == prop.runner.model_info.num_blocks   # finished: blocks back


def test_a_draft_model_with_another_vocabulary_is_refused(llm, tmp_path, capsys):
    other = tiny_llama(tmp_path / "other", 256, 1)
    cfg = dataclasses.replace(llm.scheduler_config, speculative="draft", draft_model=other)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.make_engine(cfg)
    assert main(["generate", "--prompt", "hi", "--speculative", "draft", "--draft-model", other,
                 "--max-tokens", "2"]) == 2
    assert "served model's tokenizer" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--speculative", "draft", "--max-tokens", "2"]) == 2
    assert "--draft-model" in capsys.readouterr().err


def test_a_draft_model_proposes_for_all_decodes_of_a_batch_in_one_pass_a_position(llm):
    """Three requests decoding together, SmolLM2 as its own draft: with batched proposals each
    draft position is one forward pass of the draft model over every request still drafting
    (fewer passes than asking one request at a time, and some with several rows), the drafts are
    the same tokens as asked one at a time (the GGUF kernels keep a row independent of its batch),
    and the output is unchanged. Accepted drafts keep their draft K/V: after a request's first
    proposal (its prompt), a proposal's first pass computes at most 2 of its tokens (the bonus
    token, and the last draft when all were accepted), never all the verification added."""
    prompts = ["Name three rivers in Europe.", "Count from one to ten.", "What is the capital of Italy?"]
    ids = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    base = [o.output_token_ids for o in llm.make_engine(llm.scheduler_config).generate(ids, params)]
    cfg = dataclasses.replace(llm.scheduler_config, speculative="draft", draft_model=str(resolve_model(None).path),
                              num_speculative_tokens=3)
    runs = {}
    for batched in (True, False):
        engine = fixed_cost(llm.make_engine(cfg))
        prop = engine.scheduler.speculator.proposer
        if not batched:
            prop.propose_batch = None              # Speculator.propose_many asks one at a time
        rows, first_pass, seen = [], [], set()
        run = prop.runner.execute

        def counted(batch, _run=run, _rows=rows, _first=first_pass, _seen=seen):
            _rows.append(len(batch.seqs))
            for c in batch.seqs:
                if c.output_index == 0:              # a proposal's first pass
                    if c.req_id in _seen:
                        _first.append(len(c.token_ids))
                    _seen.add(c.req_id)
            return _run(batch)
        prop.runner.execute = counted
        outs = [o.output_token_ids for o in engine.generate(ids, params)]
        st = engine.stats()
        runs[batched] = (rows, st["spec_proposed_tokens"], st["spec_accepted_tokens"])
        assert outs == base, batched
        assert first_pass and max(first_pass) <= 2, first_pass
        assert len(prop.free_blocks) == prop.runner.model_info.num_blocks
    (rows_b, prop_b, acc_b), (rows_1, prop_1, acc_1) = runs[True], runs[False]
    assert max(rows_b) >= 2 and max(rows_1) == 1
    assert len(rows_b) < len(rows_1) and sum(rows_b) == sum(rows_1)
    assert (prop_b, acc_b) == (prop_1, acc_1) and acc_b > 0
