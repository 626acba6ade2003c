"""Pick one token per row of logits, following each request's SamplingParams.

The logits a token is drawn from (and its logprobs are computed from), in order:
1. the model's raw logits (float32);
2. penalties (shared.sampling.SamplingParams): repetition_penalty over prompt + generated
   tokens, then frequency and presence penalties over generated tokens (vLLM's order);
3. logit_bias: added per token;
4. min_tokens: EOS and stop_token_ids set to -inf until min_tokens tokens were generated;
5. the constraint's mask (guided.py): tokens the request's grammar forbids set to -inf,
   all constrained rows of the batch at once;
6. temperature: logits / temperature (temperature 0 = greedy: argmax of step 5, no scaling).
logprobs are the log-softmax of step 6 ("processed" logprobs, the distribution the token is
drawn from before top-k / top-p truncation, so the constrained one; vLLM's default is the raw
log-softmax of step 1).
Then top-k, then top-p (keep the smallest most-likely set whose mass reaches top_p; the top token
always survives), then one draw (an exponential race, exactly distributed as a multinomial draw).
top_k_top_p is the one implementation of those two rules; the device sampler (device_sampler.py)
calls it too.

A seeded request draws with a generator seeded step_seed(seed, output_index), so its i-th token
does not depend on what else was in the batch or on earlier preemptions; unseeded requests share
one global generator.

Device-neutral: torch ops on the logits tensor where it lives; only token ids and the requested
logprob numbers leave it (as Python numbers).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from shared.messages import SeqChunk
from shared.sampling import SamplingParams, step_seed
from worker_svc.sampling.guided import Guides, apply_logit_bias, apply_token_bitmask
from worker_svc.sampling.token_history import TokenHistory


@dataclass
class SamplerOutput:
    """tokens: one id per row. logprobs: row index -> [logprob of the token, [top ids], [top
    logprobs]] for rows whose request asked for logprobs."""

    tokens: list[int]
    logprobs: dict[int, list] = field(default_factory=dict)


class TokenSampler(Protocol):
    """Draws one token per due sequence of a batch and keeps what drawing needs across batches
    (token histories for penalties, grammar matchers for constraints: `guides`, a
    guided.Guides). Sampler is the host implementation, DeviceFirstSampler the device one; a
    device backend picks one (worker_svc.backends.DeviceBackend.sampler)."""

    def observe(self, chunks: list[SeqChunk]) -> None:
        """Record every chunk of a batch (sampled or not) before sampling."""

    def free(self, req_ids: list[str]) -> None:
        """Drop the per-request state of finished / preempted requests; unknown ids are fine."""

    def prepare(self, due: list[SeqChunk]) -> None:
        """Start, before the forward pass, what sampling `due` needs and can overlap it (the
        constrained rows' grammar masks: guided.py)."""

    def sample_chunks(self, logits: torch.Tensor, due: list[SeqChunk],
                      agree: Callable[[list[int]], list[int]] | None = None) -> SamplerOutput:
        """logits [S, V] (on the backend's device) of the rows due a token -> one token each
        (and logprobs where asked); agree maps the drawn tokens to the ones kept (TP)."""


class Sampler:
    """eos_token_ids: what min_tokens holds back (with each request's stop_token_ids)."""

    def __init__(self, seed: int | None = None, eos_token_ids: list[int] | tuple = ()):
        self.global_generator = torch.Generator()
        if seed is None:
            self.global_generator.seed()
        else:
            self.global_generator.manual_seed(seed)
        self.eos_token_ids = list(eos_token_ids)
        self.history = TokenHistory()
        self.guides = Guides(self.history)    # grammar matchers of constrained requests

    def free(self, req_ids: list[str]) -> None:
        """Drop the per-request state (token history, grammar matcher) of finished / preempted
        requests."""
        self.history.free(req_ids)
        self.guides.free(req_ids)

    def prepare(self, due: list[SeqChunk]) -> None:
        """Start what can run beside the forward pass (the constrained rows' masks); call after
        observe(), with the rows sample_chunks will get."""
        self.guides.prepare(due)

    def observe(self, chunks: list[SeqChunk]) -> None:
        """Record every chunk of the batch (sampled or not) before sampling."""
        for c in chunks:
            self.history.observe(c)

    def sample_chunks(self, logits: torch.Tensor, due: list[SeqChunk],
                      agree: Callable[[list[int]], list[int]] | None = None) -> SamplerOutput:
        """logits [S, V] of the rows due a token (one per chunk of `due`, observed first) ->
        tokens (and logprobs where asked). agree: maps the drawn tokens to the ones kept (tensor
        parallelism: TP rank 0's, broadcast to every rank of the last stage); the logprobs are
        those of the kept tokens."""
        params = [s.sampling for s in due]
        steps = [i for i, s in enumerate(due)
                 if s.sampling.has_penalties or s.output_index < s.sampling.min_tokens]
        mask = self.guides.take(due)
        if steps or mask is not None or any(p.logit_bias for p in params):
            logits = logits.float().clone()
            for i in steps:
                self._penalize(logits[i], due[i])
            apply_logit_bias(logits, due)
            for i in steps:
                self._hold_back_eos(logits[i], due[i])
            if mask is not None:
                apply_token_bitmask(logits, mask)
        tokens = self.sample(logits, params, [s.output_index for s in due])
        if agree is not None:
            tokens = agree(tokens)
        self.guides.advance(due, tokens)
        out = SamplerOutput(tokens)
        for i, p in enumerate(params):
            if p.logprobs is not None:
                out.logprobs[i] = token_logprobs(logits[i], p, tokens[i])
        return out

    def _penalize(self, row: torch.Tensor, chunk: SeqChunk) -> None:
        """Step 2 of the module doc, in place on one row."""
        p = chunk.sampling
        if p.has_penalties:
            prompt, generated = self.history.split(chunk)
            apply_penalties(row, prompt, generated, p)

    def _hold_back_eos(self, row: torch.Tensor, chunk: SeqChunk) -> None:
        """Step 4 of the module doc, in place on one row."""
        p = chunk.sampling
        if chunk.output_index < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
            banned = [t for t in banned if t < row.shape[-1]]
            if banned:
                row[torch.tensor(banned, dtype=torch.int64, device=row.device)] = float("-inf")

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_indices: list[int]) -> list[int]:
        """logits [S, V] (already processed) -> S token ids. Greedy rows share one argmax call."""
        tokens = first_argmax(logits).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = self._draw(logits[i], p, output_indices[i])
        return tokens

    def _draw(self, logits: torch.Tensor, p: SamplingParams, output_index: int) -> int:
        probs = filtered_probs(logits, p)
        if p.seed is None:
            gen = self.global_generator
        else:
            gen = torch.Generator(device=logits.device).manual_seed(step_seed(p.seed, output_index))
        # Exponential race: argmax(p_i / E_i), E_i ~ Exp(1) i.i.d., is an exact draw from p (the
        # Gumbel-max trick in another form), and over a 49k vocabulary ~15x cheaper on a CPU
        # than torch.multinomial (74 ms a row there, under load: the soak's bottleneck).
        race = torch.empty_like(probs).exponential_(generator=gen)
        return int(first_argmax(probs / race))


def apply_penalties(row: torch.Tensor, prompt: list[int], generated: list[int], p: SamplingParams) -> None:
    """In place on one float row [V]: repetition (prompt + generated), frequency, presence."""
    vocab, dev = row.shape[-1], row.device
    if p.repetition_penalty != 1.0 and (prompt or generated):
        seen = torch.tensor(prompt + generated, dtype=torch.int64, device=dev).unique()
        seen = seen[seen < vocab]
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if generated and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64, device=dev),
                                minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def token_logprobs(row: torch.Tensor, p: SamplingParams, token: int) -> list:
    """[logprob of `token`, [top-k ids], [top-k logprobs]] of one processed row [V] (step 6 of
    the module doc), k = p.logprobs, most likely first."""
    row = row.float()
    if not p.greedy:
        row = row / p.temperature
    lp = row.log_softmax(-1)
    top = torch.topk(lp, p.logprobs) if p.logprobs else None
    chosen = float(lp[token])
    if top is None:
        return [chosen, [], []]
    return [chosen, top.indices.tolist(), top.values.tolist()]


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension, the same index as torch.argmax: the first maximum (a NaN
    counts as the maximum). Through max(), whose CPU kernel is faster than argmax's over a
    vocabulary-wide row: greedy decoding and the verification of k + 1 rows call it each step."""
    return x.max(dim=-1).indices


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities [V] after temperature, top-k and top-p (zero outside the kept set)."""
    scaled = (logits.float() / p.temperature).unsqueeze(0)
    return top_k_top_p(scaled, [p.top_k], [p.top_p])[0].softmax(-1)


def top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """x [S, V] float32 logits (already divided by the temperature) -> x with the tokens that
    top-k, then top-p, drop set to -inf; row s follows top_k[s] and top_p[s].

    Top-k keeps the tokens >= the k-th largest logit (ties at the cut all stay; k outside
    1 .. V - 1 keeps every token). Top-p then sorts what is left, most likely first, and drops a
    token when the probability mass strictly before it already reaches top_p (top_p >= 1 keeps
    every token); the most likely token always stays. Returns x itself when no row filters."""
    vocab, dev = x.shape[-1], x.device
    ks = [k if 0 < k < vocab else 0 for k in top_k]        # 0: this row keeps every token
    if any(ks):
        # the k-th largest value by selection: exact, whatever the row's other values
        kth = torch.topk(x, max(ks), dim=-1).values.gather(
            1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None])        # [S, 1]
        if not all(ks):
            kth = kth.masked_fill(torch.tensor([k == 0 for k in ks], device=dev)[:, None], float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    use_p = [p < 1.0 for p in top_p]
    if any(use_p):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop = (probs.cumsum(-1) - probs) >= torch.tensor(top_p, dtype=torch.float32, device=dev)[:, None]
        if not all(use_p):
            drop &= torch.tensor(use_p, device=dev)[:, None]
        drop[:, 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return x
