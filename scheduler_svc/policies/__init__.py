"""Scheduling policies: one small module each, one registry here.

Adding a policy: write a Policy subclass in its own module and list it in POLICY_CLASSES. Its
name is then a choice of the CLI's --policy (POLICIES) and of SchedulerConfig.policy.
"""
from __future__ import annotations

from scheduler_svc.policies.base import Policy, StepContext
from scheduler_svc.policies.chunked_only import ChunkedOnlyPolicy
from scheduler_svc.policies.faster_transformer import FasterTransformerPolicy
from scheduler_svc.policies.hybrid_only import HybridOnlyPolicy
from scheduler_svc.policies.orca import OrcaPolicy
from scheduler_svc.policies.sarathi import SarathiPolicy
from scheduler_svc.policies.vllm import VLLMPolicy
from shared.config import SchedulerConfig

POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (SarathiPolicy, VLLMPolicy, OrcaPolicy, FasterTransformerPolicy,
                HybridOnlyPolicy, ChunkedOnlyPolicy)
}
POLICIES: tuple[str, ...] = tuple(POLICY_CLASSES)   # the names, in the CLI's order


def make_policy(config: SchedulerConfig, max_model_len: int) -> Policy:
    """The policy named by config.policy; max_model_len in tokens. Raises ValueError for a
    name not in POLICIES."""
    try:
        cls = POLICY_CLASSES[config.policy]
    except KeyError:
        raise ValueError(f"unknown policy {config.policy!r}; choose one of "
                         f"{', '.join(POLICY_CLASSES)}") from None
    return cls(config, max_model_len)


__all__ = ["Policy", "StepContext", "POLICIES", "POLICY_CLASSES", "make_policy"]
