"""vLLM's prefill-prioritizing schedule (vLLM v0 without chunked prefill).

If the head of the waiting queue fits (memory, max_num_seqs, max_num_batched_tokens), the
iteration is prefill-only: whole prompts, FCFS, while they fit. Otherwise it is decode-only.
Running decodes therefore pause whenever new prompts arrive (generation stalls), which is
what gives vLLM its throughput and its TBT spikes.
"""
from __future__ import annotations

from scheduler_svc.policies.base import Policy, StepContext


class VLLMPolicy(Policy):
    name = "vllm"

    def plan(self, ctx: StepContext) -> None:
        self.take_whole_prompts(ctx, self.config.max_num_batched_tokens)
        if not ctx.chunks:
            self.take_all_decodes(ctx)
            self.take_drafts(ctx, self.config.max_num_batched_tokens)
