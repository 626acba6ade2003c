"""Ablation "hybrid-batching only" (paper Table 4): Sarathi's hybrid batches with tau = the
maximum model length, so prompts are (almost) never chunked: decodes piggyback on whole
prefills, and an iteration with a long prompt is long."""
from __future__ import annotations

from scheduler_svc.policies.sarathi import SarathiPolicy


class HybridOnlyPolicy(SarathiPolicy):
    name = "hybrid_only"

    def token_budget(self) -> int:
        return self.max_model_len

    def tile_size(self) -> int:
        return 0  # nothing is cut on purpose, so nothing to align
