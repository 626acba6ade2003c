"""Constrained decoding on the sampling rank: one llguidance matcher per constrained request.

A request whose SamplingParams.constraint is set (an llguidance grammar, shared.constraints)
gets a matcher here, keyed by request id, the first time a token is due for it. The matcher's
state is a pure function of the tokens the request generated, which the worker's TokenHistory
holds (a constraint makes the scheduler send SeqChunk.prior_token_ids to a worker new to the
request). So before each mask the matcher is reconciled with the history: tokens it has not
consumed yet are consumed, and if what it consumed is not a prefix of the generated tokens
(the request was preempted and recomputed, replayed after a worker restart, or found its
prefix in the cache on another worker) it is reset and fed the generated tokens again. n > 1
choices are separate requests, so each has its own matcher. A freed request's matcher goes.

The masks of a batch's constrained rows are filled into one int32 bitmask [R, ceil(V / 32)]
(bit t of row r allows token t; V: the logits' width, the model's padded vocabulary) by
llguidance's thread pool, which releases the GIL: ModelRunner.execute starts the fill before the
forward pass (prepare) and the sampler waits for it after (take). apply_token_bitmask then sets
every forbidden logit to -inf on the logits' device, for all constrained rows at once (the CPU
sampler and the CUDA device sampler share it; only the unpacking of the bits differs, numpy on
the host, torch ops on an accelerator).

A matcher that fails (a token the mask did not allow, which the mask makes impossible, or an
internal limit) is logged and from then on lets only EOS through: the request ends, the batch
does not fail.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from shared.constraints import parser_limits
from shared.messages import SeqChunk
from worker_svc.sampling.token_history import TokenHistory

log = logging.getLogger("sarathi.worker")


class ConstraintUnavailableError(RuntimeError):
    """A constrained request reached a worker that has no tokenizer to build its matcher."""


@dataclass
class _Guide:
    grammar: str
    matcher: object                       # llguidance.LLMatcher
    consumed: list[int] = field(default_factory=list)


@dataclass
class GuideMask:
    """rows: indices into the due rows; bitmask: int32 [len(rows), ceil(V / 32)] on the host."""

    rows: list[int]
    bitmask: torch.Tensor


class Guides:
    """The matchers of one sampler. history: the sampler's TokenHistory (what matchers are
    rebuilt from). bind() gives the tokenizer (lazily loaded: only constrained requests need
    it) and the logits' width."""

    def __init__(self, history: TokenHistory):
        self.history = history
        self._load: Callable[[], object] | None = None
        self._vocab_size = 0
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._guides: dict[str, _Guide] = {}
        self._executor = None                 # llguidance.LLExecutor, made with the tokenizer
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[list[str], Future] | None = None

    def bind(self, load_tokenizer: Callable[[], object], vocab_size: int) -> None:
        """load_tokenizer() -> shared.tokenizer.Tokenizer of the served model; vocab_size: the
        logits' width (>= the tokenizer's vocabulary)."""
        self._load, self._vocab_size = load_tokenizer, vocab_size
        self._ll_tokenizer = None

    def __len__(self) -> int:
        return len(self._guides)

    def free(self, req_ids: list[str]) -> None:
        for r in req_ids:
            self._guides.pop(r, None)

    def clear(self) -> None:
        self._guides.clear()

    def tokenizer(self):
        """The llguidance tokenizer (built on first use, about 0.5 s plus loading the model's
        tokenizer)."""
        with self._lock:
            if self._ll_tokenizer is None:
                if self._load is None:
                    raise ConstraintUnavailableError("this worker has no tokenizer for constrained decoding")
                import llguidance

                from shared.constraints import ll_tokenizer
                self._ll_tokenizer = ll_tokenizer(self._load(), self._vocab_size or None)
                self._executor = llguidance.LLExecutor(num_threads=max(1, min(4, torch.get_num_threads())))
            return self._ll_tokenizer

    # ------------------------------------------------------------------ masks
    def prepare(self, due: list[SeqChunk]) -> None:
        """Start filling the masks of `due` (observed already) in the background; take() with
        the same rows collects them."""
        if not any(c.sampling.constraint is not None for c in due):
            return
        if self._pending is not None:    # a batch that failed before sampling: let its fill end
            self._pending[1].exception()
            self._pending = None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._pending = ([c.req_id for c in due], self._pool.submit(self.masks, due))

    def take(self, due: list[SeqChunk]) -> GuideMask | None:
        """The masks of `due`: the prepared ones when prepare() was given these rows, else
        filled now. None when no row is constrained."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == [c.req_id for c in due]:
            return pending[1].result()
        if pending is not None:
            pending[1].exception()  # other rows: wait for it, so no two fills share a matcher
        return self.masks(due)

    def masks(self, due: list[SeqChunk]) -> GuideMask | None:
        rows = [i for i, c in enumerate(due) if c.sampling.constraint is not None]
        if not rows:
            return None
        tok = self.tokenizer()
        width = (tok.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), width), -1, dtype=torch.int32)
        matchers = [(self._sync(due[i]).matcher, k) for k, i in enumerate(rows)]
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), width * 4, len(rows))
        for (m, k) in matchers:
            if m.is_error():
                self._only_eos(bitmask[k], tok.eos_tokens)
        return GuideMask(rows, bitmask)

    def draft_masks(self, chunk: SeqChunk, drafts: list[int]) -> torch.Tensor:
        """int32 bitmask [k + 1, ceil(V / 32)] of a constrained chunk with k drafts: row i allows
        what the grammar allows after the request's generated tokens and drafts[:i], so row i of
        the verification sees the distribution decoding without drafts would have given there.
        From the first draft the grammar forbids on, the rows allow every token (verification
        rejects that draft at its own row, and no later row is read). The matcher is left where
        it was (llguidance rolls the drafts back); the tokens verification keeps reach it
        through the token history at the request's next mask."""
        if self._pending is not None:     # a fill in flight may use this executor: let it end
            self._pending[1].exception()
        tok = self.tokenizer()
        width = (tok.vocab_size + 31) // 32
        bitmask = torch.full((len(drafts) + 1, width), -1, dtype=torch.int32)
        g = self._sync(chunk)
        self._executor.unsafe_compute_mask_ptr_with_draft_token(
            [(g.matcher, 0, list(drafts))], bitmask.data_ptr(), width * 4, len(drafts) + 1)
        if g.matcher.is_error():
            for row in bitmask:
                self._only_eos(row, tok.eos_tokens)
        return bitmask

    def advance(self, due: list[SeqChunk], tokens: list[int]) -> None:
        """Feed each constrained row's matcher the token kept for it."""
        for c, t in zip(due, tokens):
            g = self._guides.get(c.req_id) if c.sampling.constraint is not None else None
            if g is None:
                continue
            if not g.matcher.consume_token(t):
                log.warning("request %s: token %d rejected by its grammar (%s); only EOS from now on",
                            c.req_id, t, g.matcher.get_error())
            g.consumed.append(t)

    def _sync(self, chunk: SeqChunk) -> _Guide:
        """The request's matcher, in the state after the tokens it has generated so far."""
        import llguidance

        grammar = chunk.sampling.constraint
        _, generated = self.history.split(chunk)
        g = self._guides.get(chunk.req_id)
        if g is None or g.grammar != grammar:
            # log_level 0: llguidance's own stderr warnings off; failures are logged here
            matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=parser_limits())
            g = self._guides[chunk.req_id] = _Guide(grammar, matcher)
            if g.matcher.is_error():
                log.warning("request %s: grammar error %s", chunk.req_id, g.matcher.get_error())
        n = len(g.consumed)
        if n > len(generated) or g.consumed != generated[:n]:
            g.matcher.reset()           # recomputed or replayed: rebuild from its tokens
            g.consumed, n = [], 0
        if n < len(generated):
            g.matcher.consume_tokens(generated[n:])
            g.consumed.extend(generated[n:])
        return g

    @staticmethod
    def _only_eos(row: torch.Tensor, eos: list[int]) -> None:
        words = [0] * row.shape[0]
        for t in eos:
            words[t // 32] |= 1 << (t % 32)
        row.copy_(torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32))


def apply_token_bitmask(logits: torch.Tensor, mask: GuideMask) -> None:
    """In place on logits [S, V] (any device, float): rows mask.rows keep only the tokens their
    bitmask allows; every other logit of those rows becomes -inf. Bits past V are ignored and
    logits past the bitmask's width are forbidden (mask width = the logits' width)."""
    vocab = logits.shape[-1]
    allowed = unpack_bitmask(mask.bitmask, logits.device)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    forbidden = ~allowed[:, :vocab]
    if mask.rows == list(range(logits.shape[0])):       # every row constrained: no gather
        logits.masked_fill_(forbidden, float("-inf"))
        return
    rows = torch.tensor(mask.rows, dtype=torch.int64, device=logits.device)
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill(forbidden, float("-inf")))


def unpack_bitmask(bitmask: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """int32 bitmask [R, W] on the host -> bool [R, 32 W] on `device` (bit t of word w: token
    32 w + t, little-endian as llguidance writes it). On the CPU numpy's unpackbits (one C pass;
    torch's shift-and-compare is several passes over R x V); on an accelerator the packed mask
    crosses (V / 8 bytes a row) and is unpacked there with torch ops."""
    if torch.device(device).type == "cpu":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    return unpack_bitmask_torch(bitmask.to(device, non_blocking=True))


def unpack_bitmask_torch(packed: torch.Tensor) -> torch.Tensor:
    """unpack_bitmask with torch ops where `packed` lives (the accelerator path)."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    return ((packed[:, :, None] >> shifts) & 1).bool().reshape(packed.shape[0], -1)


def apply_logit_bias(logits: torch.Tensor, due: list[SeqChunk]) -> None:
    """In place on logits [S, V]: add each row's SamplingParams.logit_bias (ids past V ignored),
    all rows in one scatter."""
    vocab = logits.shape[-1]
    rows, cols, vals = [], [], []
    for i, c in enumerate(due):
        for t, b in c.sampling.logit_bias:
            if t < vocab:
                rows.append(i)
                cols.append(t)
                vals.append(float(b))
    if rows:
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)
