"""The sampling features behind the OpenAI parameters, below the API: penalties, min_tokens and
logprobs in the worker's sampler (hand-computed expectations), the worker's per-request token
history (built from chunks, correct across preemption and prefix-cache hits), and n siblings
sharing their prompt's KV blocks in the scheduler."""
from __future__ import annotations

import math

import pytest
import torch

from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sim_executor import sim_engine
from shared.config import CacheConfig, SchedulerConfig
from shared.messages import SeqChunk
from shared.sampling import InvalidRequestError, SamplingParams
from tests.support.engine_helpers import make_executor, make_tiny_checkpoint, use_threads
from worker_svc.sampling import MissingHistoryError, TokenHistory
from worker_svc.sampling.sampler import Sampler, apply_penalties, token_logprobs

V = 12


def sp(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 50, **kw})


def test_penalties_follow_the_openai_and_ctrl_rules():
    row = torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0, 0.0])
    apply_penalties(row, prompt=[0, 1], generated=[2, 2, 4],
                    p=sp(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25))
    # token 0 (prompt, positive) /2; 1 (prompt, negative) *2; 2 twice generated: /2 - 2*0.5 - 0.25;
    # 4 once: /2 - 0.5 - 0.25; 3 and 5 untouched
    assert row.tolist() == pytest.approx([1.0, -4.0, 0.5 - 1.0 - 0.25, 0.5, 1.5 - 0.5 - 0.25, 0.0])


def chunk(req_id, tokens, start, sample=True, out=0, prior=None, **kw) -> SeqChunk:
    return SeqChunk(req_id, tokens, start, list(range(8)), sample, sp(**kw), out, prior)


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, V)
    logits[0, 1] = 10.0   # EOS, most likely
    logits[0, 5] = 9.0    # a stop token id, next
    sampler = Sampler(0, eos_token_ids=[1])
    c = chunk("a", [3], 4, out=1, min_tokens=2, stop_token_ids=[5])
    sampler.observe([c])
    assert sampler.sample_chunks(logits, [c]).tokens[0] not in (1, 5)
    c2 = chunk("a", [7], 5, out=2, min_tokens=2, stop_token_ids=[5])
    sampler.observe([c2])
    assert sampler.sample_chunks(logits, [c2]).tokens == [1]


def test_logprobs_are_the_log_softmax_of_the_tempered_logits_of_the_sampled_row():
    torch.manual_seed(0)
    logits = torch.randn(2, V) * 3
    sampler = Sampler(0)
    seqs = [chunk("g", [1], 0, logprobs=3), chunk("t", [1], 0, temperature=0.7, seed=5, logprobs=0)]
    out = sampler.sample_chunks(logits, seqs)
    g_lp = logits[0].log_softmax(-1)
    chosen, top_ids, top_lps = out.logprobs[0]
    assert out.tokens[0] == int(logits[0].argmax()) and chosen == pytest.approx(float(g_lp.max()))
    assert top_ids == g_lp.topk(3).indices.tolist() and top_lps == pytest.approx(g_lp.topk(3).values.tolist())
    t_lp = (logits[1] / 0.7).log_softmax(-1)
    assert out.logprobs[1] == [pytest.approx(float(t_lp[out.tokens[1]])), [], []]
    assert math.exp(out.logprobs[1][0]) > 0


def test_logprobs_count_the_penalties():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    row = token_logprobs(logits[0].clone(), sp(logprobs=1), 3)
    sampler = Sampler(0)
    c = chunk("p", [3, 3], 0, out=1, frequency_penalty=2.0, logprobs=1)  # 3 was generated once
    sampler.observe([c])
    out = sampler.sample_chunks(logits, [c])
    penalised = torch.tensor([0.0, 1.0, 2.0, 1.0]).log_softmax(-1)
    assert out.tokens == [2] and out.logprobs[0][0] == pytest.approx(float(penalised[2]))
    assert out.logprobs[0][0] != pytest.approx(row[0])


def test_token_history_follows_chunks_recompute_and_prior_tokens():
    h = TokenHistory()
    p = dict(frequency_penalty=1.0)
    h.observe(chunk("r", [10, 11, 12], 0, sample=False, **p))
    c = chunk("r", [13], 3, **p)
    h.observe(c)
    assert h.split(c) == ([10, 11, 12, 13], [])
    c = chunk("r", [20], 4, out=1, **p)          # the token sampled at the previous step
    h.observe(c)
    assert h.split(c) == ([10, 11, 12, 13], [20])
    c = chunk("r", [10, 11, 12, 13, 20], 0, out=1, **p)  # recomputed after a preemption
    h.observe(c)
    assert h.split(c) == ([10, 11, 12, 13], [20])
    h.free(["r"])
    with pytest.raises(MissingHistoryError):
        h.observe(chunk("r", [21], 5, out=2, **p))
    c = chunk("r", [21], 5, out=2, prior=[10, 11, 12, 13, 20], **p)  # a worker new to it
    h.observe(c)
    assert h.split(c) == ([10, 11, 12, 13], [20, 21])
    h.observe(chunk("plain", [1, 2], 7))     # no penalties: nothing kept
    assert len(h) == 1


@pytest.mark.parametrize("bad", [dict(presence_penalty=3), dict(frequency_penalty=float("nan")),
                                 dict(repetition_penalty=0), dict(min_tokens=-1), dict(min_tokens=51),
                                 dict(logprobs=21), dict(logprobs=True)])
def test_out_of_range_parameters_are_refused_naming_the_field(bad):
    with pytest.raises(InvalidRequestError) as e:
        sp(**bad)
    assert e.value.param == next(iter(bad))


# -- n siblings share their prompt's KV (scheduler, simulated worker) -------------------------------
def test_n_siblings_share_the_prompt_blocks_and_generate_what_they_would_alone():
    prompt = list(range(2, 2 + 70))                        # 4 full blocks of 16 and 6 tokens
    params = [SamplingParams(temperature=0.0, max_tokens=8) for _ in range(3)]
    alone = sim_engine(num_blocks=64).generate([prompt], params[0])[0].output_token_ids
    loop = sim_engine(num_blocks=64)
    reqs = [loop.add_request("c0", prompt, params[0])]
    reqs += [loop.scheduler.add_request(f"c{i}", prompt, params[i], share_prompt_with="c0") for i in (1, 2)]
    peak = 0
    while loop.has_unfinished():
        loop.step()
        peak = max(peak, loop.scheduler.block_manager.num_used_blocks)
    assert [r.output_token_ids for r in reqs] == [alone] * 3
    # each holds 5 blocks (70 + 8 tokens); shared: 4 prompt blocks once + 3 x 1 own
    assert peak == 4 + 3 * 1 < 3 * 5
    assert loop.scheduler.block_manager.num_free_blocks == 64


def test_a_sibling_whose_partner_is_gone_runs_alone():
    loop = sim_engine(num_blocks=64)
    r = loop.scheduler.add_request("c1", list(range(2, 40)), SamplingParams(temperature=0.0, max_tokens=3),
                                   share_prompt_with="never-seen")
    loop.run_until_done()
    assert r.finish_reason == "length"


# -- the real model runner: penalties correct across preemption and prefix-cache hits ----------------
@pytest.fixture(scope="module", autouse=True)
def _threads():
    yield from use_threads(1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama")


def engine(ckpt, num_blocks: int, prefix_caching: bool = False, token_budget: int = 512) -> EngineLoop:
    ex = make_executor(ckpt, num_blocks=num_blocks, block_size=4)
    cfg = SchedulerConfig(token_budget=token_budget, max_model_len=512, enable_prefix_caching=prefix_caching,
                          watermark=0.0)
    return EngineLoop(Scheduler(cfg, CacheConfig(4, num_blocks), ex.model_info), ex)


PENALISED = SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=1.5, presence_penalty=0.5,
                           repetition_penalty=1.3, ignore_eos=True, logprobs=2)


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 256, (12,), generator=g).tolist() for _ in range(n)]


def test_penalties_change_greedy_output_and_survive_preemption_and_prefix_hits(ckpt):
    ps = prompts(6)
    roomy = engine(ckpt, 512)
    plain = roomy.generate(ps[:1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    alone = [roomy.generate([p], PENALISED)[0] for p in ps]
    assert plain.output_token_ids != alone[0].output_token_ids     # the penalties matter here
    assert len(set(alone[0].output_token_ids)) == 24               # frequency 1.5: no repeats at all
    tight = engine(ckpt, 28, token_budget=16)   # 6 x (12 + 24) tokens do not fit 28 blocks of 4
    outs = tight.generate(ps, PENALISED)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.output_token_ids for o in outs] == [a.output_token_ids for a in alone]
    assert [[lp[1] for lp in o.logprobs] for o in outs] == [[lp[1] for lp in a.logprobs] for a in alone]
    cached = engine(ckpt, 512, prefix_caching=True)
    cached.generate([ps[0] + [7] * 8], SamplingParams(temperature=0.0, max_tokens=1))  # caches ps[0]'s blocks
    hit = cached.generate([ps[0]], PENALISED)[0]
    assert cached.scheduler.stats()["prefix_cache_hit_tokens"] > 0
    assert hit.output_token_ids == alone[0].output_token_ids


def test_logprobs_of_a_greedy_token_equal_the_log_softmax_of_the_model_logits(ckpt):
    from shared.messages import Batch

    p = prompts(1)[0]
    loop = engine(ckpt, 64)
    out = loop.generate([p], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))[0]
    ex = make_executor(ckpt, num_blocks=8, block_size=4)
    logits = ex.compute_logits(Batch(0, [SeqChunk("x", p, 0, [0, 1, 2], True, SamplingParams())]))["x"]
    lp = logits.log_softmax(-1)
    chosen, top_ids, top_lps = out.logprobs[0]
    assert out.output_token_ids[0] == top_ids[0] == int(lp.argmax())
    assert chosen == pytest.approx(float(lp.max()), abs=1e-4)
    assert top_lps == pytest.approx(lp.topk(3).values.tolist(), abs=1e-4)


def test_token_history_keeps_draft_tokens_out_of_the_generated_ones():
    """A chunk's drafts are recorded (the next chunk starts after the accepted ones) but are not
    generated tokens: split() of the chunk ends before them; the next chunk, past one accepted
    draft and the token after it, leaves exactly those."""
    import dataclasses

    h = TokenHistory()
    g = dict(constraint='{"grammars": []}')
    h.observe(chunk("r", [10, 11, 12], 0, sample=False, **g))
    h.observe(chunk("r", [13], 3, **g))
    c = dataclasses.replace(chunk("r", [20, 21, 22], 4, out=1, **g), num_draft_tokens=2)
    h.observe(c)
    assert h.split(c) == ([10, 11, 12, 13], [20])
    c = chunk("r", [30], 6, out=3, **g)          # draft 21 accepted, 30 drawn after it
    h.observe(c)
    assert h.split(c) == ([10, 11, 12, 13], [20, 21, 30])
