"""Sampling where the logits are (the GPU): only the chosen token ids cross to the host.

The same rules as the host sampler (sampler.py; temperature 0 = argmax; else logits / temperature, then
top-k, then top-p through the same function, sampler.top_k_top_p), vectorised over the rows of a
batch. The draw is Gumbel-max: token = argmax(filtered logits / T + g), g = -log(-log u),
where u in (0, 1) is a counter-based hash of (seed, output_index, token id) computed in torch
integer arithmetic. So:

* a seeded request's i-th token depends only on its own logits row, its parameters, its seed and
  i: not on what else is in the batch, nor on earlier preemptions (the noise has no state);
* there is no generator state on the device and no host round trip, so it can run inside a
  captured graph;
* the stream differs from the CPU sampler's torch.multinomial: a seed reproduces a request on
  one backend, not across CPU and GPU.

Unseeded rows draw a fresh 62-bit seed from the worker's host generator per token.
logit_bias and constraints are applied here too, on the device, by the host sampler's
device-neutral functions (guided.py): the grammar masks are filled on the host (while the
forward pass runs) and only the packed bitmask [R, V / 32] crosses to the device.
Requests with parameters this module does not implement (supports() is False: any
SamplingParams field beyond the ones below set away from its default, e.g. penalties or
logprobs) go to the host sampler: DeviceFirstSampler, the CUDA backend's sampler, decides that
per batch.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from shared.messages import SeqChunk
from shared.sampling import SamplingParams
from worker_svc.sampling.guided import apply_logit_bias, apply_token_bitmask
from worker_svc.sampling.sampler import Sampler, SamplerOutput, top_k_top_p

_M32 = 0xFFFFFFFF
# the fields this sampler implements, or that do not affect which token is drawn
_HANDLED = {"temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids", "ignore_eos",
            "logit_bias", "constraint"}   # the last two: DeviceFirstSampler, before sample()


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) int64, in 16-bit halves so no product exceeds
    2**48 (exact on every device; int64 overflow would be undefined)."""
    hi = ((x >> 16) * c) & _M32
    return ((hi << 16) + (x & 0xFFFF) * c) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32 by C. Wellons) on int64 tensors holding [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _on(device: torch.device | str, t: torch.Tensor) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the work queued there (pinned,
    non-blocking on CUDA): sampling batch n + 1 may be launched while batch n runs."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def uniform_noise(seeds: list[int], output_indices: list[int], vocab_size: int,
                  device: torch.device | str) -> torch.Tensor:
    """u [S, V] float64 in (0, 1): row s, column t is a pure function of (seeds[s],
    output_indices[s], t)."""
    keys = _on(device, torch.tensor([[s & _M32, (s >> 32) & _M32, i & _M32]
                                     for s, i in zip(seeds, output_indices)], dtype=torch.int64))
    row = hash32(hash32(hash32(keys[:, 0]) ^ keys[:, 1]) ^ keys[:, 2])            # [S]
    col = hash32((torch.arange(vocab_size, dtype=torch.int64, device=device) + 0x9E3779B9) & _M32)
    bits = hash32(row[:, None] ^ col[None, :])                                     # [S, V]
    return (bits.double() + 0.5) / 2.0 ** 32


def filtered_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [S, V] -> float32 logits / temperature with the tokens top-k and top-p drop set to
    -inf (row s follows params[s]; no row is greedy). The host sampler's rules and code
    (sampler.top_k_top_p)."""
    x = logits.float() / torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
    return top_k_top_p(x, [p.top_k for p in params], [p.top_p for p in params])


class DeviceSampler:
    """sample(logits [S, V] on the device, params, output indices) -> S token ids (host ints)."""

    def __init__(self, seed: int | None = None):
        self.host_generator = torch.Generator()
        if seed is None:
            self.host_generator.seed()
        else:
            self.host_generator.manual_seed(seed)

    @staticmethod
    def supports(params: SamplingParams) -> bool:
        """False when params set a field this sampler does not implement (see module doc)."""
        return all(getattr(params, k) == v for k, v in _unhandled_defaults(type(params)))

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_indices: list[int]) -> list[int]:
        return self.draw(logits, params, output_indices).tolist()   # the one device -> host copy

    def draw(self, logits: torch.Tensor, params: list[SamplingParams],
             output_indices: list[int]) -> torch.Tensor:
        """The tokens [S] int64, left on the device (nothing here waits for the device)."""
        tokens = logits.argmax(dim=-1)
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if drawn:
            rows = _on(logits.device, torch.tensor(drawn))
            ps = [params[i] for i in drawn]
            seeds = [p.seed if p.seed is not None else
                     int(torch.randint(0, 2 ** 62, (1,), generator=self.host_generator)) for p in ps]
            x = filtered_logits(logits.index_select(0, rows), ps)
            u = uniform_noise(seeds, [output_indices[i] for i in drawn], logits.shape[-1], logits.device)
            scores = x.double() - torch.log(-torch.log(u))
            tokens = tokens.index_copy(0, rows, scores.argmax(dim=-1))
        return tokens


@functools.lru_cache(maxsize=None)
def _unhandled_defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    """(field, default) of every field DeviceSampler does not implement. Read field by field:
    supports() runs for every due sequence of every step, and to_dict() (a deep copy) cost
    more host time a decode step than the rest of its preparation."""
    return tuple((k, v) for k, v in cls().to_dict().items() if k not in _HANDLED)


class DeviceFirstSampler:
    """The CUDA backend's sampler (a TokenSampler): a batch whose due requests all have
    parameters DeviceSampler implements is drawn on the device (only token ids cross to the
    host); any other batch (penalties, min_tokens, logprobs) goes to the host sampler on a host
    copy of the logits. The host sampler keeps the token histories either way."""

    def __init__(self, seed: int | None = None, eos_token_ids: list[int] | tuple = ()):
        self.host = Sampler(seed, eos_token_ids=eos_token_ids)
        self.device_sampler = DeviceSampler(seed)

    @property
    def guides(self):
        """The grammar matchers (the host sampler's: they live with the token histories)."""
        return self.host.guides

    def observe(self, chunks: list[SeqChunk]) -> None:
        self.host.observe(chunks)

    def prepare(self, due: list[SeqChunk]) -> None:
        self.host.prepare(due)

    def free(self, req_ids: list[str]) -> None:
        self.host.free(req_ids)

    def sample_chunks(self, logits: torch.Tensor, due: list[SeqChunk],
                      agree: Callable[[list[int]], list[int]] | None = None) -> SamplerOutput:
        """As Sampler.sample_chunks, for logits [S, V] on the device."""
        ds = self.device_sampler
        if all(ds.supports(s.sampling) for s in due):
            guides = self.host.guides
            mask = guides.take(due)
            if mask is not None or any(s.sampling.logit_bias for s in due):
                logits = logits.float().clone()     # a graph's output buffer is reused: copy first
                apply_logit_bias(logits, due)
                if mask is not None:
                    apply_token_bitmask(logits, mask)
            tokens = ds.sample(logits, [s.sampling for s in due], [s.output_index for s in due])
            tokens = agree(tokens) if agree is not None else tokens
            guides.advance(due, tokens)
            return SamplerOutput(tokens)
        return self.host.sample_chunks(logits.cpu(), due, agree=agree)

    def draw_on_device(self, logits: torch.Tensor, due: list[SeqChunk]) -> torch.Tensor | None:
        """The tokens [S] of a batch drawn on the device and left there (the caller reads them
        back later: async scheduling), or None when the host must take part (a parameter
        DeviceSampler lacks, or a grammar: its matcher advances with each token on the host)."""
        ds = self.device_sampler
        if not all(ds.supports(s.sampling) and s.sampling.constraint is None for s in due):
            return None
        if any(s.sampling.logit_bias for s in due):
            logits = logits.float().clone()
            apply_logit_bias(logits, due)
        return ds.draw(logits, [s.sampling for s in due], [s.output_index for s in due])
