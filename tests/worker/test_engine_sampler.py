"""Sampling: greedy is argmax; top-k / top-p keep the right sets; a seed makes a request's
draws reproducible whatever else is in the batch."""
from __future__ import annotations

import pytest
import torch

from shared.sampling import SamplingParams
from worker_svc.sampling.sampler import Sampler, filtered_probs, first_argmax

torch.manual_seed(0)
LOGITS = torch.randn(4, 100) * 3


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **kw})


def test_temperature_zero_is_argmax():
    got = Sampler(0).sample(LOGITS, [params(temperature=0.0)] * 4, [0] * 4)
    assert got == LOGITS.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_argmax_is_argmax_with_ties_infinities_and_nans(dtype):
    g = torch.Generator().manual_seed(1)
    for i in range(300):  # small integer logits: many ties, so the first-maximum rule is tested
        x = torch.randint(-3, 3, (5, int(torch.randint(1, 200, (1,), generator=g))), generator=g).to(dtype)
        x[0, ::3] = float("-inf")
        x[1] = float("-inf")
        if i % 3 == 0:
            x[2, x.shape[1] // 2] = float("nan")
        assert first_argmax(x).tolist() == x.argmax(-1).tolist()
    row = torch.zeros(49152, dtype=dtype)
    row[[7, 40000]] = 1.0
    assert int(first_argmax(row)) == 7


def test_top_k_keeps_exactly_the_k_most_likely():
    probs = filtered_probs(LOGITS[0], params(top_k=5))
    assert set(probs.nonzero().flatten().tolist()) == set(LOGITS[0].topk(5).indices.tolist())
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    full = logits.softmax(-1)                    # ~0.64, 0.23, 0.09, 0.03, 0.01
    kept = filtered_probs(logits, params(top_p=0.8)).nonzero().flatten().tolist()
    assert kept == [0, 1]                        # 0.64 < 0.8 <= 0.87
    assert full[0] < 0.8 <= full[:2].sum()


def test_tiny_top_p_keeps_the_top_token():
    assert filtered_probs(LOGITS[1], params(top_p=1e-6)).argmax() == LOGITS[1].argmax()


def test_seeded_draws_repeat_across_samplers_and_batch_positions():
    p = params(seed=1234, temperature=1.5)
    a = Sampler(1).sample(LOGITS[:1], [p], [7])
    b = Sampler(2).sample(torch.cat([LOGITS[2:3], LOGITS[:1]]), [params(), p], [0, 7])
    assert a[0] == b[1]


def test_seeded_draws_differ_by_output_index():
    p = params(seed=99, temperature=5.0)
    draws = {Sampler(0).sample(LOGITS[:1], [p], [i])[0] for i in range(20)}
    assert len(draws) > 1


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    sampler = Sampler(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sampler.sample(logits, [params()], [0])[0]] += 1
    assert torch.allclose(counts / 3000, logits.softmax(-1)[0], atol=0.03)
