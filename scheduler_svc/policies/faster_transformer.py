"""FasterTransformer's request-level batching: admit a batch of requests (max_num_seqs,
memory), prefill them whole, then decode until every one of them has finished; only then
admit the next batch. Early finishers leave idle slots; new arrivals wait for the batch."""
from __future__ import annotations

from scheduler_svc.policies.base import Policy, StepContext


class FasterTransformerPolicy(Policy):
    name = "faster_transformer"

    def plan(self, ctx: StepContext) -> None:
        if ctx.num_running == 0:
            self.take_whole_prompts(ctx)
        else:
            self.take_all_decodes(ctx)
            self.take_drafts(ctx, self.config.max_num_batched_tokens)
