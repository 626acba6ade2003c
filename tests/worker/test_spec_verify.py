"""Draft verification on the worker (worker_svc.sampling.speculative): greedy acceptance is
exact, and the rejection-sampling rule leaves the output distribution unchanged (chi-square
tests on a small vocabulary), with temperature, top-k, logit_bias, min_tokens and logprobs."""
from __future__ import annotations

import pytest
import torch

from shared.messages import SeqChunk
from shared.sampling import SamplingParams
from worker_svc.sampling.sampler import filtered_probs, token_logprobs
from worker_svc.sampling.speculative import process_rows, verify

V = 6
EOS = [5]
# chi-square critical values at p = 0.001 (a correct sampler fails one run in a thousand)
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def chunk(drafts, params, output_index=3):
    return SeqChunk("r", [0] + list(drafts), 10, [0, 1], True, params, output_index,
                    num_draft_tokens=len(drafts))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    n = counts.sum()
    exp = probs[keep] * n
    return float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


def test_greedy_accepts_the_argmax_prefix_and_emits_the_first_correction():
    rows = torch.tensor([[0, 3, 1, 0, 0, 0], [0, 0, 0, 4, 1, 0], [2, 0, 0, 0, 0, 0],
                         [0, 0, 0, 0, 9, 0]], dtype=torch.float32)
    p = SamplingParams(temperature=0.0)
    v = verify(rows, chunk([1, 3, 4], p), EOS)
    assert (v.accepted, v.token) == ([1, 3], 0)          # the third draft (4) is not the argmax (0)
    v = verify(rows, chunk([1, 3, 0], p), EOS)
    assert (v.accepted, v.token) == ([1, 3, 0], 4)       # all accepted, then the bonus token
    v = verify(rows, chunk([2, 3, 0], p), EOS)
    assert (v.accepted, v.token) == ([], 1)


def test_logit_bias_and_min_tokens_apply_per_row():
    rows = torch.zeros(3, V)
    rows[:, 5] = 5.0                                      # EOS would win every row
    p = SamplingParams(temperature=0.0, min_tokens=5, logit_bias=[(2, 3.0)], logprobs=2)
    # output index 3: rows 0 and 1 (outputs 3, 4) hold EOS back, row 2 (output 5) does not
    v = verify(rows, chunk([2, 2], p), EOS)
    assert (v.accepted, v.token) == ([2, 2], 5)
    processed = process_rows(rows, chunk([2, 2], p), EOS)
    assert v.logprobs == [token_logprobs(processed[i], p, t) for i, t in enumerate([2, 2, 5])]


def test_rows_are_copied_only_when_something_applies_and_the_logits_stay_as_they_were():
    rows = torch.randn(3, V)
    before = rows.clone()
    plain = SamplingParams(temperature=0.0)
    assert process_rows(rows, chunk([2, 2], plain), EOS) is rows   # nothing to apply: no copy
    for p in (SamplingParams(temperature=0.0, logit_bias=[(1, 50.0)]),
              SamplingParams(temperature=0.0, min_tokens=9)):
        got = process_rows(rows, chunk([2, 2], p), EOS)
        assert got is not rows and not torch.equal(got, rows)
        assert torch.equal(rows, before)


def draw_many(logits, drafts, params, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    c = chunk(drafts, params)
    return [verify(logits, c, EOS, gen) for _ in range(n)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8)],
                         ids=["plain", "top_k", "top_p"])
def test_rejection_sampling_keeps_the_target_distribution(params):
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 1.5
    p0, p1 = filtered_probs(logits[0], params), filtered_probs(logits[1], params)
    middling = [int(torch.argsort(p, descending=True)[1]) for p in (p0, p1)]
    likely = [int(p.argmax()) for p in (p0, p1)]
    for drafts in ([middling[0], likely[1]], [likely[0], middling[1]]):
        out = draw_many(logits, drafts, params, 2500)
        emitted = [v.accepted + [v.token] for v in out]
        # the first token (accepted draft or residual draw) is distributed as row 0 without drafts
        first = torch.tensor([e[0] for e in emitted])
        chi, df = chi_square(torch.bincount(first, minlength=V).float(), p0)
        assert chi < CHI2_CRIT[df], (drafts, chi, df)
        # the acceptance rate of the first draft is p0(draft)
        rate = sum(1 for v in out if v.accepted[:1] == drafts[:1]) / len(out)
        assert abs(rate - float(p0[drafts[0]])) < 4 * (0.25 / len(out)) ** 0.5
        # given the first draft was emitted, the second token follows row 1
        second = torch.tensor([e[1] for e in emitted if e[0] == drafts[0]])
        if len(second) > 600:
            chi, df = chi_square(torch.bincount(second, minlength=V).float(), p1)
            assert chi < CHI2_CRIT[df], (drafts, chi, df)
            checked = True
    assert checked


def test_a_draft_outside_top_k_is_always_rejected():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]] * 2)
    params = SamplingParams(temperature=1.0, top_k=2)
    out = draw_many(logits, [4], params, 300)
    assert all(v.accepted == [] and v.token in (0, 1) for v in out)


def test_a_mismatched_row_count_is_an_error():
    with pytest.raises(ValueError, match="rows"):
        verify(torch.zeros(2, V), chunk([1, 2], SamplingParams(temperature=0.0)), EOS)


def bitmask(rows: list[list[int]]) -> torch.Tensor:
    """int32 bitmask [len(rows), 1] allowing the listed tokens of each row (V <= 32)."""
    return torch.tensor([[sum(1 << t for t in allowed)] for allowed in rows], dtype=torch.int32)


def test_a_grammar_mask_applies_to_each_row_greedy_and_sampled():
    """Row i is masked by what the grammar allows after the drafts before it: a draft that is
    its row's raw argmax but forbidden there is rejected, and the token emitted is the best
    allowed one; sampled rows never draw a forbidden token."""
    rows = torch.tensor([[0, 3, 1, 0, 0, 0], [0, 0, 0, 4, 1, 0], [2, 0, 0, 0, 0, 0],
                         [0, 0, 0, 0, 9, 0]], dtype=torch.float32)
    greedy = SamplingParams(temperature=0.0)
    allow_all = bitmask([list(range(V))] * 4)
    assert verify(rows, chunk([1, 3, 0], greedy), EOS, mask=allow_all).accepted == [1, 3, 0]
    no_3_after_1 = bitmask([list(range(V)), [0, 1, 2, 4, 5], list(range(V)), list(range(V))])
    v = verify(rows, chunk([1, 3, 0], greedy), EOS, mask=no_3_after_1)
    assert (v.accepted, v.token) == ([1], 4)            # 3 forbidden at row 1: its best allowed is 4
    only_2_first = bitmask([[2], list(range(V)), list(range(V)), list(range(V))])
    g = torch.Generator().manual_seed(0)
    sampled = SamplingParams(temperature=1.0)
    for _ in range(200):
        v = verify(rows[:3], chunk([1, 3], sampled), EOS, g, mask=only_2_first[:3])
        assert (v.accepted, v.token) == ([], 2)         # draft 1 has probability 0 under the mask
