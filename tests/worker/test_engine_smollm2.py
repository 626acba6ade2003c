"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the
same GGUF with its own dequantizer and un-permutation (independent of worker_svc.loader)."""
from __future__ import annotations

import pytest
import torch

from shared.model_source import resolve_model
from tests.support.engine_helpers import (
    PROMPT,
    blocks_for,
    greedy_generate,
    hf_model_from_gguf,
    make_executor,
    prefill_logits,
    use_threads,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _threads():
    yield from use_threads(1)


@pytest.fixture(scope="module")
def smol():
    from shared.tokenizer import load_tokenizer

    source = resolve_model(None)
    tok = load_tokenizer(source)
    prompt = tok.encode(tok.apply_chat_template(PROMPT), add_special_tokens=False)
    return tok, prompt, hf_model_from_gguf(str(source.path)), make_executor(None, num_blocks=64)


def test_smollm2_model_info_comes_from_the_gguf(smol):
    _, _, _, ex = smol
    info = ex.model_info
    assert (info.name, info.max_model_len, info.vocab_size, info.num_layers) == \
        ("SmolLM2-135M-Instruct", 8192, 49152, 30)
    assert info.eos_token_ids == [2]           # <|im_end|>


def test_smollm2_logits_match_transformers(smol):
    _, prompt, hf, ex = smol
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    got = prefill_logits(ex, prompt, list(range(blocks_for(len(prompt), 16))), 16)
    # Q4_1 weights dequantize identically; what remains is fp32 reassociation over 30 layers
    # with logits of magnitude ~25
    assert (got - ref).abs().max().item() <= 1e-3


def test_smollm2_greedy_text_matches_transformers_generate(smol):
    tok, prompt, hf, ex = smol
    with torch.no_grad():
        # explicit mask: the prompt contains the pad id 2 (<|im_end|>), which HF would mask out
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                          do_sample=False, eos_token_id=None, pad_token_id=2)[0, len(prompt):].tolist()
    got = greedy_generate(ex, prompt, 32, list(range(blocks_for(len(prompt) + 32, 16))))
    assert tok.decode(got) == tok.decode(ref)
    assert got == ref
