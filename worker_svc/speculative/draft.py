"""Draft-model proposer: a smaller model with the served model's tokenizer guesses the next k
tokens greedily; the served model verifies them in its own batch as it verifies any drafts.

The draft model runs in the scheduler's process on its own ModelRunner and KV cache (CPU by
default). Per request it keeps a block table in that cache and how many of the request's tokens
it has computed; each proposal computes the request's new tokens (a short prefill), then k - 1
single-token decodes, one request at a time. The draft KV past the request's tokens is rewritten
by the next proposal, so a rejected guess needs no rollback here. A request that finds no free
draft blocks, or would pass the draft model's context length, gets no drafts.

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
        st = req.spec_state.get(self.name)
        if st is None:
            st = req.spec_state[self.name] = {"blocks": [], "computed": 0}
        toks = req.token_ids
        n = len(toks)
        if n + k - 1 > self.max_len:
            return []
        need = cdiv(n + k - 1, self.block_size) - len(st["blocks"])
        if need > len(self.free_blocks):
            return []
        for _ in range(need):
            st["blocks"].append(self.free_blocks.pop())
        start = min(st["computed"], n - 1)       # at least the last token: its logits are needed
        drafts = [self._step(req.req_id, toks[start:], start, st["blocks"], 0)]
        for i in range(1, k):
            drafts.append(self._step(req.req_id, [drafts[-1]], n - 1 + i, st["blocks"], i))
        st["computed"] = n
        return drafts

    def _step(self, req_id: str, tokens: list[int], start: int, blocks: list[int], index: int) -> int:
        out = self.runner.execute(Batch(next(self._batch_ids),
                                        [SeqChunk(req_id, tokens, start, list(blocks), True, GREEDY, index)]))
        return out.sampled[req_id]

    def finish(self, req) -> None:
        """req ended: its draft blocks go back."""
        st = req.spec_state.pop(self.name, None)
        if st is not None:
            self.free_blocks.extend(st["blocks"])
            self.runner.free([req.req_id])
