"""The message types that cross a process boundary. Torch-free, msgpack-friendly.

Two families:

* scheduler -> worker (one iteration): `Batch` of `SeqChunk`s; worker -> scheduler: `BatchOutput`.
  This is the in-process contract between the scheduler's engine loop and any executor
  (the worker's model runner, a ZeroMQ client to remote workers, or a simulated worker).
  The wire protocol of the worker service (full data once, diffs after) is built on top of it
  in worker_svc / scheduler_svc and re-creates exactly these objects on the worker side.
* gateway <-> scheduler (one request): `RequestMsg`, `TokenEvent`, carried by the queue (Redis
  streams, or an in-process queue in embedded mode); an abort is just the request id (see
  shared.queue).

Units: token counts and positions are in tokens; times are seconds (time.time() or an injected
clock, as documented at the field).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from shared.sampling import SamplingParams

# ---------------------------------------------------------------------------------------------
# scheduler -> worker: one iteration
# ---------------------------------------------------------------------------------------------
PENDING_TOKEN = -1   # a decode's token id before it is known: the one its previous chunk samples


@dataclass
class SeqChunk:
    """One sequence's share of an iteration.

    Invariants:
    * token_ids are the tokens whose K/V are computed in this step, at positions
      start_pos .. start_pos + len(token_ids) - 1. A decode has exactly one token (the last
      sampled one); a prefill chunk has >= 1 prompt tokens.
    * start_pos == number of tokens of this sequence already in the KV cache (cached prefix).
    * block_table lists the physical KV block ids of the sequence in logical order and covers
      at least start_pos + len(token_ids) tokens (block_size tokens per block).
    * sample is True iff a token is due after this step: a decode, or the chunk that ends the
      prompt. Only those rows go through the LM head.
    * output_index is how many tokens the request has generated before this step; with a seed,
      the token is drawn with shared.sampling.step_seed(seed, output_index).
    * prior_token_ids, when set, are the request's tokens at positions 0 .. start_pos - 1. The
      scheduler sets them on every chunk past position 0 of a request whose sampling reads
      earlier tokens (penalties), so a worker that sees the request for the first time (a
      prefix-cache hit, KV shared with a sibling, a new wire epoch) knows the whole sequence; the
      wire sends them only in full entries (a diff's worker already holds them).
    * num_draft_tokens (speculative decoding): the last k of token_ids are draft tokens proposed
      for positions after the last sampled token, not tokens of the request. Such a chunk is a
      decode to verify: sample is True, and the worker scores all k+1 positions in this one
      forward pass, keeps the longest prefix of the drafts the target model accepts (exactly
      under greedy, by rejection sampling otherwise) and samples one token after it
      (BatchOutput.accepted). K/V written for rejected drafts are garbage the scheduler rolls
      back: their positions are computed again before anything attends to them.
    * A decode scheduled ahead (async scheduling: the scheduler plans batch n + 1 while batch n
      runs) has token_ids == [PENDING_TOKEN]: its token is the one this request's chunk in the
      batch before samples, which the scheduler does not know yet. The executor that ran that
      batch fills it in before anything reads it (the wire decoder from its mirror, the model
      runner from its last outputs); output_index already counts it.
    """

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    sampling: SamplingParams
    output_index: int = 0
    prior_token_ids: list[int] | None = None
    num_draft_tokens: int = 0

    @property
    def is_decode(self) -> bool:
        """One sampled token after the request's first output: a decode step (metrics and cost
        models count these apart from prefill and recompute tokens)."""
        return self.sample and self.output_index > 0 and len(self.token_ids) == 1

    @property
    def is_ahead(self) -> bool:
        """A decode scheduled ahead, whose token is still PENDING_TOKEN (see the invariants)."""
        return len(self.token_ids) == 1 and self.token_ids[0] == PENDING_TOKEN

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d["sampling"] = self.sampling.to_dict()
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "SeqChunk":
        d = dict(d)
        d["sampling"] = SamplingParams.from_dict(d["sampling"])
        return cls(**d)


def fill_pending(batch: "Batch", last_sampled: dict[str, int]) -> "Batch":
    """`batch` with the token of each decode planned ahead (SeqChunk.is_ahead) filled in from
    `last_sampled`, the tokens the executor sampled in the batch before (a copy; `batch` itself
    when it has none). Raises ValueError naming the request whose token is not there."""
    if not any(s.token_ids and s.token_ids[0] == PENDING_TOKEN for s in batch.seqs):
        return batch
    seqs = []
    for s in batch.seqs:
        if s.token_ids and s.token_ids[0] == PENDING_TOKEN:
            if not s.is_ahead or s.req_id not in last_sampled:
                raise ValueError(f"request {s.req_id}: a pending token this worker did not sample "
                                 "in the batch before (a decode planned ahead must follow its "
                                 "request's sampling chunk on the same worker)")
            s = replace(s, token_ids=[last_sampled[s.req_id]])
        seqs.append(s)
    return replace(batch, seqs=seqs)


@dataclass
class KvSend:
    """Prefill/decode disaggregation: after this batch's forward pass, the worker sends the K/V
    of blocks `src_blocks` (its own block ids) straight to the worker whose KV receiver listens
    at `dst_address`, which writes them into its blocks `dst_blocks` (same length, same logical
    order) and acknowledges. The scheduler reserved the dst blocks; nothing else references them
    until the handoff completed. timeout_s: seconds the send may take at most (the lease on the
    prefill side's blocks); after it the send is reported failed."""

    req_id: str
    src_blocks: list[int]
    dst_address: str
    dst_blocks: list[int]
    timeout_s: float = 10.0

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "KvSend":
        return cls(**d)


@dataclass
class Batch:
    """One iteration: a hybrid batch. Order: decodes first, then prefill chunks (by convention
    of the sarathi policy; executors must accept any order).

    freed_req_ids: requests that finished, were aborted or preempted since the last batch;
    the worker drops any per-request state it holds for them (their blocks are already free
    in the scheduler's block manager).
    kv_sends: KV blocks to send to another worker once this batch's forward pass is done (the
    prompt KV of requests whose last prompt chunk is in this batch; disaggregation only).
    ahead: the scheduler plans each batch while the one before runs (async scheduling), so the
    next batch may arrive before this one's tokens are back: a worker may hold this one,
    launched, and take the next first (worker_svc.service). False: answer as soon as possible.
    """

    batch_id: int
    seqs: list[SeqChunk]
    freed_req_ids: list[str] = field(default_factory=list)
    kv_sends: list[KvSend] = field(default_factory=list)
    ahead: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def to_wire(self) -> dict[str, Any]:
        d = {"batch_id": self.batch_id, "seqs": [s.to_wire() for s in self.seqs],
             "freed_req_ids": list(self.freed_req_ids)}
        if self.kv_sends:
            d["kv_sends"] = [k.to_wire() for k in self.kv_sends]
        if self.ahead:
            d["ahead"] = True
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Batch":
        return cls(d["batch_id"], [SeqChunk.from_wire(s) for s in d["seqs"]], list(d["freed_req_ids"]),
                   [KvSend.from_wire(k) for k in d.get("kv_sends") or ()], bool(d.get("ahead", False)))


@dataclass
class BatchOutput:
    """The result of one iteration.

    sampled: req_id -> sampled token id, exactly for the SeqChunks with sample=True.
    timings: seconds, e.g. {"forward_s": ..., "total_s": ...}, measured on the worker.
    logprobs: req_id -> [logprob of the sampled token, [top token ids], [their logprobs]], only
        for sampled requests whose SamplingParams.logprobs is not None (top lists of that length,
        most likely first). Only these numbers cross the wire, never a logits row.
    kv_sent: req_id -> {"kv_transfer_s": seconds from the start of the send to the receiver's
        ack, "kv_bytes": bytes moved}, for each KvSend of the batch that the receiver acknowledged.
    kv_failed: req_id -> reason ("timeout", or the error), for each KvSend that did not complete.
    accepted: req_id -> the draft tokens accepted (a prefix of the chunk's drafts, possibly
        empty), exactly for the SeqChunks with num_draft_tokens > 0; sampled[req_id] is then
        the token drawn after them, so the request gains len(accepted) + 1 tokens, in order
        accepted..., sampled.
    accepted_logprobs: req_id -> one logprobs entry (as in `logprobs`) per accepted token, for
        requests with drafts that asked for logprobs.
    """

    batch_id: int
    sampled: dict[str, int]
    timings: dict[str, float] = field(default_factory=dict)
    logprobs: dict[str, list] = field(default_factory=dict)
    kv_sent: dict[str, dict] = field(default_factory=dict)
    kv_failed: dict[str, str] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        d = {"batch_id": self.batch_id, "sampled": self.sampled, "timings": self.timings}
        if self.accepted:
            d["accepted"] = self.accepted
        if self.accepted_logprobs:
            d["accepted_logprobs"] = self.accepted_logprobs
        if self.logprobs:
            d["logprobs"] = self.logprobs
        if self.kv_sent:
            d["kv_sent"] = self.kv_sent
        if self.kv_failed:
            d["kv_failed"] = self.kv_failed
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "BatchOutput":
        return cls(d["batch_id"], dict(d["sampled"]), dict(d.get("timings", {})),
                   dict(d.get("logprobs") or {}), dict(d.get("kv_sent") or {}),
                   dict(d.get("kv_failed") or {}), dict(d.get("accepted") or {}),
                   dict(d.get("accepted_logprobs") or {}))


# ---------------------------------------------------------------------------------------------
# gateway <-> scheduler: one request
# ---------------------------------------------------------------------------------------------
@dataclass
class RequestMsg:
    """A request accepted by a gateway. arrival_time: time.time() at the gateway (seconds).

    share_prompt_with: the id of a sibling request with the same prompt (one of the n choices
    of one API call): a scheduler that holds that sibling waits for its prompt's KV and shares
    those blocks instead of computing them again. A hint: without the sibling it runs alone."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    arrival_time: float
    share_prompt_with: str | None = None

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d["sampling"] = self.sampling.to_dict()
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "RequestMsg":
        d = dict(d)
        d["sampling"] = SamplingParams.from_dict(d["sampling"])
        return cls(**d)


@dataclass
class TokenEvent:
    """One generated token (or the end) of a request, sent to its gateway.

    index: 0-based position of token_id in the request's output; the gateway drops an event
        whose index it has already seen (replays after a scheduler restart resend them).
    token_id: None on a pure end/error event.
    finish_reason: None while running; "stop" | "length" | "abort" | "error" at the end.
    error: a human-readable message when finish_reason == "error".
    scheduled_time: time.time() (seconds) when a scheduler took the request from the queue; set
        on the first event (index 0) by the queue if the scheduler leaves it None. The gateway's
        queue-time metric is scheduled_time - arrival_time.
    logprob, top_logprobs: when the request asked for logprobs: token_id's log-probability and
        [[token id, logprob], ...] of the most likely tokens (see SamplingParams.logprobs).
    epoch: the publishing owner's epoch of the request, set by the queue (0: unfenced); the
        gateway side drops events older than the newest epoch it saw (see shared.queue).
    """

    req_id: str
    index: int
    token_id: int | None
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    scheduled_time: float | None = None
    logprob: float | None = None
    top_logprobs: list[list] | None = None
    epoch: int = 0

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "TokenEvent":
        return cls(**d)

