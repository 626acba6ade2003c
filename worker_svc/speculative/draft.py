"""Draft-model proposer: a smaller model with the served model's tokenizer guesses the next k
tokens greedily; the served model verifies them in its own batch as it verifies any drafts.

The draft model runs in the scheduler's process on its own ModelRunner and KV cache (CPU by
default). Per request it keeps a block table in that cache and how many of the request's tokens
it has computed; each proposal computes the request's new tokens (a short prefill), then k - 1
single-token decodes. The decodes of one scheduler batch are proposed together
(propose_batch): one forward pass of the draft model per draft position, over every request
still drafting at it (its first a hybrid batch of each request's new tokens), so a batch of B
decodes costs max(k) draft steps of B rows, not the sum of k steps of one; the same tokens as
asking one at a time where the draft model's kernels keep a row independent of its batch (the
GGUF block kernels do). The draft KV past the request's tokens is rewritten by the next
proposal, so a rejected guess needs no rollback here; an accepted one keeps its draft KV:
draft i's K/V were computed at its position by the pass that proposed draft i + 1, so the next
proposal starts after the last draft that was both accepted and computed, and its first pass
is one or two tokens a request rather than all the tokens the verification added. A request
that finds no free draft blocks, or would pass the draft model's context length, gets no
drafts.

A draft model must share the served model's vocabulary: its vocabulary size and EOS ids are
compared with the served model's when the proposer is built, and a mismatch is refused with a
message (tokens of one tokenizer mean nothing to another).
"""
from __future__ import annotations

import itertools

from shared.config import CacheConfig, ModelInfo, WorkerConfig, cdiv
from shared.messages import Batch, SeqChunk
from shared.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


class DraftModelProposer:
    name = "draft"

    def __init__(self, model: str, target: ModelInfo | None, *, num_blocks: int = 512,
                 block_size: int = 16, threads: int = 0, dtype: str = "auto"):
        from worker_svc.model_runner import ModelRunner  # torch lives behind this import

        self.runner = ModelRunner(WorkerConfig(model=model, dtype=dtype, num_threads=threads,
                                               cache=CacheConfig(block_size=block_size,
                                                                 num_blocks=num_blocks)))
        info = self.runner.model_info
        if target is not None and (info.vocab_size != target.vocab_size
                                   or sorted(info.eos_token_ids) != sorted(target.eos_token_ids)):
            raise ValueError(
                f"the draft model {info.name} has {info.vocab_size} tokens (EOS {info.eos_token_ids}) "
                f"but the served model {target.name} has {target.vocab_size} (EOS "
                f"{target.eos_token_ids}): a draft model must use the served model's tokenizer")
        self.block_size = block_size
        self.max_len = info.max_model_len
        self.free_blocks = list(range(info.num_blocks))
        self._batch_ids = itertools.count()

    def propose(self, req, k: int) -> list[int]:
        return self._draft([(req, k)])[0]

    def propose_batch(self, asks) -> list[list[int]]:
        """[drafts] of each (request, k) of asks, in order (module doc): draft position i of
        every request with k > i in one forward pass."""
        return self._draft(asks)

    def _draft(self, asks) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in asks]
        live = []                                # (index in asks, request, k, its state)
        for j, (req, k) in enumerate(asks):
            st = req.spec_state.get(self.name)
            if st is None:
                st = req.spec_state[self.name] = {"blocks": [], "computed": 0, "drafts": []}
            n = len(req.token_ids)
            st["computed"] += self._kept(req.token_ids, st)
            st["drafts"] = []                    # consumed: computed has moved past them
            if k < 1 or n + k - 1 > self.max_len:
                continue
            need = cdiv(n + k - 1, self.block_size) - len(st["blocks"])
            if need > len(self.free_blocks):
                continue
            for _ in range(need):
                st["blocks"].append(self.free_blocks.pop())
            live.append((j, req, k, st))
        for i in range(max((k for _, _, k, _ in live), default=0)):
            chunks = []
            for j, req, k, st in live:
                if k <= i:
                    continue
                n = len(req.token_ids)
                if i == 0:
                    start = min(st["computed"], n - 1)   # at least the last token: its logits are needed
                    chunks.append(SeqChunk(req.req_id, req.token_ids[start:], start, list(st["blocks"]), True,
                                           GREEDY, 0))
                else:
                    chunks.append(SeqChunk(req.req_id, [drafts[j][-1]], n - 1 + i, list(st["blocks"]), True,
                                           GREEDY, i))
            out = self.runner.execute(Batch(next(self._batch_ids), chunks))
            for j, req, k, _ in live:
                if k > i:
                    drafts[j].append(out.sampled[req.req_id])
        for j, req, _, st in live:
            st["computed"], st["drafts"] = len(req.token_ids), drafts[j]
        return drafts

    @staticmethod
    def _kept(tokens: list[int], st: dict) -> int:
        """Positions past st["computed"] whose draft K/V still hold: the last proposal's drafts
        that the request's tokens now have in their places (accepted), all but the last of
        them (its K/V was never computed); their K/V were written at those positions by that
        proposal's later passes."""
        n0, d = st["computed"], st.get("drafts") or []
        kept = 0
        for i in range(len(d) - 1):
            if n0 + i >= len(tokens) or tokens[n0 + i] != d[i]:
                break
            kept += 1
        return kept

    def finish(self, req) -> None:
        """req ended: its draft blocks go back."""
        st = req.spec_state.pop(self.name, None)
        if st is not None:
            self.free_blocks.extend(st["blocks"])
            self.runner.free([req.req_id])
