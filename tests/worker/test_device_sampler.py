"""Sampling on the device (run here on CPU tensors): greedy is argmax; a seeded request's token
depends only on its own row, parameters, seed and output index, whatever else is in the batch;
top-k / top-p keep exactly the sets the host sampler keeps; draws follow the distribution."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.sampling import SamplingParams
from worker_svc.sampling.device_sampler import DeviceSampler, filtered_logits, hash32, uniform_noise
from worker_svc.sampling.sampler import filtered_probs

V = 50


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=11),
          SamplingParams(temperature=1.3, top_k=5, seed=12), SamplingParams(temperature=1.0, top_p=0.7, seed=13),
          SamplingParams(temperature=0.5, top_k=8, top_p=0.9, seed=14), SamplingParams(temperature=2.0, seed=15)]


def test_greedy_rows_are_argmax():
    logits = rows(7)
    got = DeviceSampler(0).sample(logits, [SamplingParams(temperature=0.0)] * 7, list(range(7)))
    assert got == logits.argmax(-1).tolist()


def test_seeded_tokens_do_not_depend_on_the_batch_composition():
    logits = rows(len(PARAMS), seed=1)
    idx = [3, 0, 7, 2, 5, 9]
    alone = [DeviceSampler(0).sample(logits[i:i + 1], [PARAMS[i]], [idx[i]])[0] for i in range(len(PARAMS))]
    together = DeviceSampler(1).sample(logits, PARAMS, idx)
    assert together == alone
    perm = [4, 2, 5, 0, 3, 1]
    others = rows(3, seed=9)              # unrelated rows around them, other sampler seed
    mixed_logits = torch.cat([others[:2], logits[perm], others[2:]])
    mixed_params = [SamplingParams(temperature=1.0)] * 2 + [PARAMS[i] for i in perm] + [SamplingParams(temperature=0.7)]
    mixed = DeviceSampler(2).sample(mixed_logits, mixed_params, [1, 1] + [idx[i] for i in perm] + [4])
    assert mixed[2:-1] == [alone[i] for i in perm]


def test_seeded_draws_change_with_the_output_index_and_the_seed():
    logits = torch.zeros(1, V)
    draws = {DeviceSampler().sample(logits, [SamplingParams(temperature=1.0, seed=5)], [i])[0] for i in range(60)}
    assert len(draws) > 20                 # uniform over 50 tokens: 60 indices hit many of them
    seeds = {DeviceSampler().sample(logits, [SamplingParams(temperature=1.0, seed=s)], [0])[0] for s in range(60)}
    assert len(seeds) > 20


@pytest.mark.parametrize("i", range(1, len(PARAMS)))
def test_filtering_keeps_what_the_host_sampler_keeps(i):
    logits = rows(4, seed=i)
    params = [PARAMS[i]] * 4
    got = filtered_logits(logits, params).softmax(-1)
    want = torch.stack([filtered_probs(logits[r], PARAMS[i]) for r in range(4)])
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-6)


def test_draws_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0, -3.0]])
    p = SamplingParams(temperature=0.9, top_p=0.95)
    want = filtered_probs(logits[0], p)
    n = 20000
    params = [dataclasses.replace(p, seed=s) for s in range(n)]
    got = DeviceSampler().sample(logits.expand(n, -1), params, [0] * n)
    freq = torch.bincount(torch.tensor(got), minlength=6).double() / n
    assert (freq - want.double()).abs().max() < 0.015
    assert freq[want == 0].sum() == 0      # a dropped token is never drawn


def test_unseeded_rows_follow_the_worker_seed():
    logits = rows(5, seed=3)
    p = [SamplingParams(temperature=1.0)] * 5
    assert DeviceSampler(42).sample(logits, p, [0] * 5) == DeviceSampler(42).sample(logits, p, [0] * 5)


def _lowbias32(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_hash_is_exact_32_bit_arithmetic():
    xs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]
    assert hash32(torch.tensor(xs, dtype=torch.int64)).tolist() == [_lowbias32(x) for x in xs]


def test_noise_is_a_function_of_seed_index_and_token():
    u = uniform_noise([1, 2, 1, -5, 2**40 + 3], [0, 0, 1, 0, 0], V, "cpu")
    assert ((u > 0) & (u < 1)).all()
    again = uniform_noise([1, -5], [1, 0], V, "cpu")
    assert torch.equal(again[0], u[2]) and torch.equal(again[1], u[3])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


@dataclasses.dataclass
class _ParamsWithPenalty(SamplingParams):
    presence_penalty: float = 0.0


def test_unknown_parameters_go_to_the_host_sampler():
    assert DeviceSampler.supports(SamplingParams(temperature=0.7, top_k=3, top_p=0.5, seed=1))
    assert DeviceSampler.supports(_ParamsWithPenalty())
    assert not DeviceSampler.supports(_ParamsWithPenalty(presence_penalty=0.5))
    for other in (dict(min_tokens=2), dict(logprobs=0), dict(repetition_penalty=1.2), dict(frequency_penalty=0.5)):
        assert not DeviceSampler.supports(SamplingParams(temperature=0.7, **other)), other
    assert DeviceSampler.supports(SamplingParams(temperature=0.0, stop_token_ids=[3], ignore_eos=True))
