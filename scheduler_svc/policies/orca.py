"""Orca's iteration-level scheduling: one hybrid batch of every running decode plus whole new
prompts (no chunking), bounded only by the batch-size cap (max_num_seqs) and memory. Decodes
never pause, but they ride along in iterations as long as the longest prompt."""
from __future__ import annotations

from scheduler_svc.policies.base import Policy, StepContext


class OrcaPolicy(Policy):
    name = "orca"

    def plan(self, ctx: StepContext) -> None:
        self.take_all_decodes(ctx)
        self.take_whole_prompts(ctx)
        self.take_drafts(ctx, self.config.max_num_batched_tokens)
