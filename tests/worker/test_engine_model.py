"""The engine computes what Hugging Face transformers computes, however the work is batched:
tiny random Llama / Qwen2-with-bias / Llama-3-rope-scaling checkpoints, fp32."""
from __future__ import annotations

import pytest
import torch

from shared.messages import Batch
from tests.support.engine_helpers import (
    TINY_CONFIGS,
    BlockPool,
    blocks_for,
    chunk,
    greedy_generate,
    make_executor,
    make_tiny_checkpoint,
    prefill_logits,
    use_threads,
)

ATOL = 1e-4        # the bound for fp32 logits vs transformers
BS = 16


@pytest.fixture(scope="module", autouse=True)
def _threads():
    yield from use_threads(1)


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny(request, tmp_path_factory):
    """(checkpoint dir, HF model, model runner) for one tiny config."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf, make_executor(path, num_blocks=128, block_size=BS)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_match_transformers_at_every_position(tiny):
    _, hf, ex = tiny
    prompt = prompt_of(40)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    table = list(range(blocks_for(len(prompt), BS)))
    # prefill the first 10 tokens, then feed the rest one decode at a time
    got = [prefill_logits(ex, prompt[:10], table, 10)]
    for pos in range(10, len(prompt)):
        got.append(ex.compute_logits(Batch(0, [chunk("r", [prompt[pos]], pos, table, True)]))["r"])
    assert (torch.stack(got) - ref[9:]).abs().max().item() <= ATOL


def test_greedy_continuation_matches_transformers_generate(tiny):
    _, hf, ex = tiny
    prompt = prompt_of(50, seed=1)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    got = greedy_generate(ex, prompt, 32, list(range(blocks_for(82, BS))))
    assert got == ref


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_chunked_prefill_gives_the_same_last_logits_as_whole(tiny, chunk_size):
    _, _, ex = tiny
    prompt = prompt_of(100, seed=2)
    table = list(range(blocks_for(100, BS)))
    whole = prefill_logits(ex, prompt, table, len(prompt))
    assert (prefill_logits(ex, prompt, table, chunk_size) - whole).abs().max().item() <= 1e-5


def test_hybrid_batch_gives_each_sequence_what_it_gets_alone(tiny):
    _, _, ex = tiny
    pool = BlockPool(128)
    prompts = {f"d{i}": prompt_of(20 + 9 * i, seed=10 + i) for i in range(3)}
    tables = {r: pool.take(blocks_for(len(p) + 1, BS)) for r, p in prompts.items()}
    first = {r: int(prefill_logits(ex, p, tables[r], len(p), r).argmax()) for r, p in prompts.items()}
    long_prompt, long_table = prompt_of(70, seed=20), pool.take(blocks_for(70, BS))
    prefill_logits(ex, long_prompt[:30], long_table, 30, "p")          # cached prefix of 30

    decodes = [chunk(r, [first[r]], len(p), tables[r], True) for r, p in prompts.items()]
    piece = chunk("p", long_prompt[30:], 30, long_table, True)        # chunk that ends the prompt
    hybrid = ex.compute_logits(Batch(1, decodes + [piece]))
    alone = {s.req_id: ex.compute_logits(Batch(2, [s]))[s.req_id] for s in decodes + [piece]}
    for req_id, logits in alone.items():
        assert (hybrid[req_id] - logits).abs().max().item() <= 1e-5, req_id


def test_shuffled_block_tables_equal_contiguous(tiny):
    _, _, ex = tiny
    prompt = prompt_of(45, seed=3)
    n = blocks_for(45 + 20, BS)
    contiguous = greedy_generate(ex, prompt, 20, BlockPool(128).take(n), chunk_size=16)
    shuffled = greedy_generate(ex, prompt, 20, BlockPool(128, shuffle_seed=7).take(n), chunk_size=16)
    assert shuffled == contiguous


@pytest.mark.parametrize("group_tokens", [8192, 40])
def test_decodes_of_different_lengths_batch_together(tiny, group_tokens, monkeypatch):
    """Padded decode attention masks each sequence's tail: short and long contexts mix, in
    one group or (small cap) split into several groups, out of batch order."""
    monkeypatch.setattr("worker_svc.backends.torch_attention.DECODE_GROUP_TOKENS", group_tokens)
    _, _, ex = tiny
    pool = BlockPool(128)
    lens = [5, 33, 64, 17]
    seqs = []
    for i, n in enumerate(lens):
        p, table = prompt_of(n + 1, seed=30 + i), pool.take(blocks_for(n + 1, BS))
        prefill_logits(ex, p[:n], table, n, f"s{i}")
        seqs.append(chunk(f"s{i}", [p[n]], n, table, True))
    together = ex.compute_logits(Batch(0, seqs))
    for s in seqs:
        assert (together[s.req_id] - ex.compute_logits(Batch(0, [s]))[s.req_id]).abs().max() <= 1e-5


def test_model_info_describes_the_checkpoint(tiny):
    path, hf, ex = tiny
    info = ex.model_info
    assert (info.max_model_len, info.vocab_size, info.num_layers) == (512, 256, 2)
    assert info.eos_token_ids == [1]
    assert (info.block_size, info.num_blocks) == (BS, 128)
    assert info.name == path.name


def test_bfloat16_engine_is_as_accurate_as_transformers_in_bfloat16(tiny):
    """bf16 cannot match fp32 to 1e-4; it must not drift further than HF's own bf16 does."""
    from transformers import AutoModelForCausalLM

    path, hf32, _ = tiny
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ex16 = make_executor(path, dtype="bfloat16", num_blocks=16, block_size=BS)
    prompt = prompt_of(60, seed=4)
    with torch.no_grad():
        ref = hf32(torch.tensor([prompt])).logits[0, -1]
        hf_err = (hf16(torch.tensor([prompt])).logits[0, -1].float() - ref).abs().max().item()
    got = prefill_logits(ex16, prompt, list(range(blocks_for(60, BS))), 25)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() <= 1.5 * hf_err + 1e-2
