"""The token ids of each request as the worker has seen them: what penalties read.

Kept only for requests whose sampling reads earlier tokens (SamplingParams.reads_history:
penalties or a constraint),
keyed by request id, built from the chunks the worker executes (the wire's "full data once, then
diffs": a decode chunk's one token is the token sampled at the previous step) and dropped when
the request is freed (finished, aborted, preempted) or the wire starts a new epoch. A chunk that
starts past what is known carries SeqChunk.prior_token_ids (scheduler side), so the history is
right after preemption, a prefix-cache hit, KV shared with a sibling, or a worker restart.

Pure Python; device-neutral.
"""
from __future__ import annotations

from shared.messages import SeqChunk


class MissingHistoryError(ValueError):
    """A chunk starts after tokens this worker never saw, and brings no prior_token_ids."""


class TokenHistory:
    def __init__(self) -> None:
        self._seqs: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def free(self, req_ids: list[str]) -> None:
        for r in req_ids:
            self._seqs.pop(r, None)

    def clear(self) -> None:
        self._seqs.clear()

    def observe(self, chunk: SeqChunk) -> None:
        """Record the chunk's tokens at positions start_pos.. (a recompute from an earlier
        position overwrites what followed it). No-op for requests that read no history."""
        if not chunk.sampling.reads_history:
            return
        if chunk.prior_token_ids is not None:
            seq = list(chunk.prior_token_ids)
        else:
            seq = self._seqs.get(chunk.req_id, [])
        if len(seq) < chunk.start_pos:
            raise MissingHistoryError(
                f"request {chunk.req_id}: chunk starts at {chunk.start_pos} but only {len(seq)} earlier "
                "tokens are known to this worker (send prior_token_ids)")
        del seq[chunk.start_pos:]
        seq.extend(chunk.token_ids)
        self._seqs[chunk.req_id] = seq

    def split(self, chunk: SeqChunk) -> tuple[list[int], list[int]]:
        """(prompt ids, generated ids) of the sequence through the end of `chunk` (observed
        first) but its draft tokens: the output_index tokens before the drafts are the
        generated ones."""
        seq = self._seqs[chunk.req_id]
        # a chunk's draft tokens are recorded (the next chunk starts after the accepted ones,
        # dropping the rest) but are not generated tokens yet
        end = len(seq) - chunk.num_draft_tokens
        cut = end - chunk.output_index
        return seq[:cut], seq[cut:end]
