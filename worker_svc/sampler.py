"""Pick one token per row of logits, following each request's SamplingParams.

temperature 0 = argmax. Otherwise: logits / temperature, then top-k, then top-p (keep the
smallest most-likely set whose mass reaches top_p; the top token always survives), then one
multinomial draw. A seeded request draws with a generator seeded step_seed(seed, output_index),
so its i-th token does not depend on what else was in the batch or on earlier preemptions;
unseeded requests share one global generator.
"""
from __future__ import annotations

import torch

from shared.sampling import SamplingParams, step_seed


class Sampler:
    def __init__(self, seed: int | None = None):
        self.global_generator = torch.Generator()
        if seed is None:
            self.global_generator.seed()
        else:
            self.global_generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_indices: list[int]) -> list[int]:
        """logits [S, V] float32 -> S token ids. Greedy rows share one argmax call."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = self._draw(logits[i], p, output_indices[i])
        return tokens

    def _draw(self, logits: torch.Tensor, p: SamplingParams, output_index: int) -> int:
        probs = filtered_probs(logits, p)
        if p.seed is None:
            gen = self.global_generator
        else:
            gen = torch.Generator().manual_seed(step_seed(p.seed, output_index))
        return int(torch.multinomial(probs, 1, generator=gen))


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities [V] after temperature, top-k and top-p (zero outside the kept set)."""
    logits = logits.float() / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits.softmax(-1)
