"""Sampling on the worker: one token per due sequence, drawn from its logits by its request's
SamplingParams (shared.sampling). This module is the package's one entry point: code outside
it imports only the names below.

* sampler.py: Sampler, the host sampler (penalties, logit_bias, min_tokens, constraints,
  temperature, top-k / top-p, logprobs), and TokenSampler, the protocol every sampler follows;
* device_sampler.py: DeviceFirstSampler, which draws where the logits are (only token ids cross
  to the host) when a batch's parameters allow and hands other batches to the host sampler.
  Torch ops only, on whatever device holds the logits: importing it imports no CUDA code and no
  FlashInfer, so the CPU path may import it;
* guided.py: Guides, constrained decoding (one llguidance matcher per request, token bitmasks
  filled while the forward pass runs);
* speculative.py: verify, the acceptance of a decode chunk's draft tokens (greedy: exact;
  sampled: the rejection-sampling rule for point-mass drafts; a grammar's mask per row);
* token_history.py: TokenHistory, each request's tokens as the worker saw them (what penalties
  and matchers read).

Which sampler a worker uses is its device backend's choice (worker_svc.backends,
DeviceBackend.sampler). Invariants across samplers: the same filtering rules (one
implementation, sampler.top_k_top_p); a seeded request's i-th token depends only on its own
logits row, parameters, seed and i, never on the rest of the batch.
"""
from worker_svc.sampling.device_sampler import DeviceFirstSampler, DeviceSampler
from worker_svc.sampling.guided import ConstraintUnavailableError, Guides
from worker_svc.sampling.sampler import Sampler, SamplerOutput, TokenSampler
from worker_svc.sampling.speculative import Verified, draft_tokens, emitted_logprobs, verify
from worker_svc.sampling.token_history import MissingHistoryError, TokenHistory

__all__ = ["ConstraintUnavailableError", "DeviceFirstSampler", "DeviceSampler", "Guides", "MissingHistoryError",
           "Sampler", "SamplerOutput", "TokenHistory", "TokenSampler", "Verified", "draft_tokens",
           "emitted_logprobs", "verify"]
