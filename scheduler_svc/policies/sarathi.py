"""Sarathi-Serve's stall-free batching (the paper's Algorithm 3).

Each iteration: every running decode (one token each), then the partial prefills, then new
requests, all within the token budget tau, which counts the decode tokens too. The last
prefill is cut to the budget left, so no iteration is much longer than a decode-only one and
decodes never wait for a prefill (no generation stall).

With an adaptive budget (config.adaptive_tbt_slo_s), tau is the controller's, updated from every
batch's observed time (scheduler_svc/token_budget.py).

Tile alignment (paper section 4.3): matmuls run in tiles of tile_size tokens, so a batch of
tile_size * k + 1 tokens costs about one tile more than it needs; when the last chunk was cut
by the budget, it is cut further so the batch's token count is a multiple of tile_size.
"""
from __future__ import annotations

from scheduler_svc.policies.base import Policy, StepContext
from scheduler_svc.token_budget import AdaptiveTokenBudget


class SarathiPolicy(Policy):
    name = "sarathi"

    def __init__(self, config, max_model_len):
        super().__init__(config, max_model_len)
        self.adaptive = None   # with config.adaptive_tbt_slo_s: tau follows the SLO (token_budget.py)
        if config.adaptive_tbt_slo_s > 0:
            self.adaptive = AdaptiveTokenBudget(
                config.adaptive_tbt_slo_s, tile=config.tile_size or 32, initial=config.token_budget,
                max_tau=max(config.max_num_batched_tokens, config.tile_size or 32))

    def token_budget(self) -> int:
        """tau, in tokens per iteration."""
        return self.adaptive.tau if self.adaptive is not None else self.config.token_budget

    def observe(self, num_tokens: int, seconds: float, now: float) -> None:
        if self.adaptive is not None:
            self.adaptive.observe(num_tokens, seconds, now)

    def tile_size(self) -> int:
        """Tokens per matmul tile to align the batch to; 0 = off."""
        return self.config.tile_size

    def plan(self, ctx: StepContext) -> None:
        budget = self.token_budget()
        self.take_all_decodes(ctx, budget)
        self.take_chunked_prefills(ctx, budget)
        if self.tile_size() > 0:
            self.align_to_tile(ctx, self.tile_size())
        self.take_drafts(ctx, budget)     # speculative decoding: only from what is left

    @staticmethod
    def align_to_tile(ctx: StepContext, tile: int) -> None:
        """Shrink the last chunk if it is a prefill cut short and the batch overhangs a tile
        boundary by fewer tokens than the chunk has (the chunk keeps >= 1 token)."""
        if not ctx.chunks:
            return
        req, n = ctx.chunks[-1]
        cut_short = n < req.num_new_tokens
        overhang = ctx.num_tokens % tile
        if cut_short and 0 < overhang < n:
            ctx.shrink_last(overhang)
