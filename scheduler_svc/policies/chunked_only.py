"""Ablation "chunked-prefills only" (paper Table 4): prompts are split into chunks of up to
tau tokens, but batches are not hybrid: prefill-only turns (chunks within tau) alternate with
decode-only turns (every running decode). When only one kind of work exists, it runs every
iteration."""
from __future__ import annotations

from scheduler_svc.policies.base import Policy, StepContext


class ChunkedOnlyPolicy(Policy):
    name = "chunked_only"

    def __init__(self, config, max_model_len):
        super().__init__(config, max_model_len)
        self._last_was_prefill = False

    def plan(self, ctx: StepContext) -> None:
        turns = [self._decode_turn, self._prefill_turn]
        if not self._last_was_prefill:
            turns.reverse()
        for turn in turns:
            turn(ctx)
            if ctx.chunks:
                self._last_was_prefill = turn == self._prefill_turn
                return

    def _prefill_turn(self, ctx: StepContext) -> None:
        self.take_chunked_prefills(ctx, self.config.token_budget)

    def _decode_turn(self, ctx: StepContext) -> None:
        self.take_all_decodes(ctx)
        self.take_drafts(ctx, self.config.token_budget)
