"""Verifying draft tokens (speculative decoding): k drafts in, the accepted prefix and one new
token out, from the target model's logits at the k + 1 positions of one decode chunk.

The rows: row i (0 <= i <= k) holds the logits after the chunk's i-th token, i.e. the target
model's distribution for output index output_index + i, given the request's tokens and drafts
1..i before it. Each row is processed as the host sampler processes a row (sampler.py's module
doc): logit_bias, min_tokens (per row: the EOS hold-back ends at the row whose output index
reaches min_tokens), the output constraint's mask, temperature, top-k, top-p. A constrained
request's row i is masked by what its grammar allows after the drafts before it (the caller
passes those masks: worker_svc.sampling.guided.Guides.draft_masks), which is the mask decoding
without drafts would apply there whenever those drafts are accepted. Penalties depend on the
counts of the tokens before each row, so requests with them are never given drafts (the
scheduler's rule, checked by the model runner).

The acceptance rule. Drafts come from proposers that name one token per position, a point-mass
draft distribution q = onehot(d). Standard speculative sampling (Leviathan et al.; Chen et al.)
accepts d_i with probability min(1, p(d_i) / q(d_i)) = p(d_i), where p is row i's processed
distribution, and at the first rejection draws the row's token from the residual
max(p - q, 0) / sum(...), i.e. p with d_i removed and renormalized; when every draft is
accepted, the last row gives a bonus token drawn from p. Each emitted token is then distributed
exactly as it would be without drafts. Greedy (temperature 0) is the limit: d_i is accepted
iff it is the row's argmax, and the first mismatch emits the argmax, so the output is identical
to decoding without drafts (up to the floating-point differences of scoring k + 1 positions in
one pass, which never changed an argmax in the tests on the default model).

Random numbers come from the generator passed in (unseeded requests only: the scheduler gives
no drafts to seeded sampled requests, whose tokens must not depend on how many drafts were
scheduled).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.messages import SeqChunk
from worker_svc.sampling.guided import GuideMask, apply_token_bitmask
from worker_svc.sampling.sampler import filtered_probs, first_argmax, token_logprobs


@dataclass
class Verified:
    """accepted: the drafts kept (a prefix of the chunk's drafts); token: the one drawn after
    them; logprobs: per emitted token (accepted..., token), when the request asked for them."""

    accepted: list[int]
    token: int
    logprobs: list[list] | None = None


def draft_tokens(chunk: SeqChunk) -> list[int]:
    k = chunk.num_draft_tokens
    return list(chunk.token_ids[len(chunk.token_ids) - k:]) if k else []


def process_rows(logits: torch.Tensor, chunk: SeqChunk, eos_token_ids: list[int],
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """logits [k+1, V] -> float32 rows after logit_bias, the min_tokens hold-back and, when
    given, the grammar's int32 bitmask [k+1, W]: a copy, or the logits themselves (float32)
    when none of those applies. Callers never write to the rows."""
    p = chunk.sampling
    held = p.min_tokens - chunk.output_index          # rows 0 .. held - 1 may not end the request
    if mask is None and not p.logit_bias and held <= 0:
        return logits.float()
    rows = logits.float().clone()
    if mask is not None:
        apply_token_bitmask(rows, GuideMask(list(range(rows.shape[0])), mask))
    vocab = rows.shape[-1]
    for t, b in p.logit_bias:
        if t < vocab:
            rows[:, t] += float(b)
    if held > 0:
        banned = [t for t in list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
                  if t < vocab]
        if banned:
            rows[:held, torch.tensor(banned, dtype=torch.int64, device=rows.device)] = float("-inf")
    return rows


def verify(logits: torch.Tensor, chunk: SeqChunk, eos_token_ids: list[int],
           generator: torch.Generator | None = None, mask: torch.Tensor | None = None) -> Verified:
    """The accepted drafts and the next token of one chunk with drafts (see the module doc).
    logits: [k+1, V], on any device; generator: on the logits' device (sampled requests);
    mask: a constrained request's int32 bitmask [k+1, W] on the host (Guides.draft_masks)."""
    drafts = draft_tokens(chunk)
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"request {chunk.req_id}: {logits.shape[0]} logits rows for {k} drafts")
    p = chunk.sampling
    rows = process_rows(logits, chunk, eos_token_ids, mask)
    accepted: list[int] = []
    if p.greedy:
        best = first_argmax(rows).tolist()
        for i, d in enumerate(drafts):
            if best[i] != d:
                break
            accepted.append(d)
        token = best[len(accepted)]
    else:
        token = None
        for i, d in enumerate(drafts):
            probs = filtered_probs(rows[i], p)
            u = torch.rand((), generator=generator, device=probs.device)
            if bool(u < probs[d]):
                accepted.append(d)
                continue
            residual = probs.clone()
            residual[d] = 0.0
            token = _draw(residual, generator)
            break
        if token is None:
            token = _draw(filtered_probs(rows[k], p), generator)
    lps = None
    if p.logprobs is not None:
        lps = _logprobs(rows, p, accepted + [int(token)])
    return Verified(accepted, int(token), lps)


def emitted_logprobs(logits: torch.Tensor, chunk: SeqChunk, eos_token_ids: list[int],
                     emitted: list[int], mask: torch.Tensor | None = None) -> list[list]:
    """The logprobs entries of `emitted` (accepted drafts, then the token after them) from the
    chunk's raw logits rows (tensor parallelism: tokens kept from another rank)."""
    return _logprobs(process_rows(logits, chunk, eos_token_ids, mask), chunk.sampling, emitted)


def _logprobs(rows: torch.Tensor, p, emitted: list[int]) -> list[list]:
    return [token_logprobs(rows[i], p, t) for i, t in enumerate(emitted)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn in proportion to non-negative `weights` (need not sum to 1): the
    exponential race of sampler.py."""
    race = torch.empty_like(weights).exponential_(generator=generator)
    return int(first_argmax(weights / race))
