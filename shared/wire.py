"""The scheduler <-> worker wire protocol: a request's full data once, only diffs after.

Torch-free; imported by both scheduler_svc.remote_executor (encoding side) and
worker_svc.service (decoding side).

Both sides keep a mirror of what the worker knows about each request (`SeqState`) and update
it in the same order, so that a diff can always be applied:

* `BatchEncoder.encode(batch)` turns a `Batch` into a msgpack-able dict and updates the mirror;
  `BatchEncoder.on_output(output)` records the sampled tokens once the worker's reply arrives.
* `BatchDecoder.decode(msg)` rebuilds exactly the original `Batch`;
  `BatchDecoder.on_output(output)` records the sampled tokens the worker just produced.

A seq entry on the wire is either *full* (key "sp" present: sampling params, chunk tokens,
start position, block table, output index) or a *diff* against the mirror:

  "r": req_id, "n": chunk length in tokens, "s": sample flag,
  "t": tokens not yet known to the worker (omitted when none: a decode's token is the one the
       worker itself sampled),
  "p": start position (omitted when it is the expected one, i.e. end of the previous chunk),
  "b+": block ids appended to the table  |  "b": a whole new table (when not a pure append),
  "o": output index (omitted when it is the expected one),
  "h" (full entries only): the tokens before the start position (SeqChunk.prior_token_ids, set
       for requests with penalties; a diff needs none, the worker already holds them),
  "k": the chunk's draft tokens (SeqChunk.num_draft_tokens; omitted when 0),
  "a": 1 for a decode planned ahead (async scheduling: SeqChunk.is_ahead): its one token is
       the one the worker samples for the request in the batch before, so no "t" carries it
       (a full entry has "t": []); the decoder fills it in from its mirror, where the worker
       recorded that batch's output, or leaves PENDING_TOKEN for the runner to fill.

A chunk planned ahead adds no token to a mirror (its token arrives with the output of the batch
before, in order); a mirror installed by one starts past it.

Draft tokens are never recorded as known: a chunk with k drafts advances the mirror by its
tokens before the drafts, and the output's accepted drafts (BatchOutput.accepted) are recorded
like sampled tokens, before the sampled one. A rank that does not sample never learns which
drafts were kept, so its next chunk of that request goes in full when some were.

Freed request ids drop the mirror on both sides. An `epoch` string names the encoder's session:
a worker that sees a new epoch forgets every mirror (the scheduler restarted), and a diff for a
request the worker does not know is a protocol error (`UnknownRequestError`) that makes the
encoder start a new epoch and send everything in full.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack

from shared.messages import PENDING_TOKEN, Batch, BatchOutput, KvSend, SeqChunk
from shared.sampling import SamplingParams


class UnknownRequestError(KeyError):
    """A diff names a request the worker holds no state for (worker restarted, lost message)."""


@dataclass
class SeqState:
    """What the worker knows about one request.

    tokens: the request's token ids at positions base .. base + len(tokens) - 1 (sent chunk
        tokens plus tokens sampled by the worker).
    next_pos: tokens whose K/V are computed after the last chunk sent (= expected start_pos).
    output_index: tokens generated so far (= expected output_index of the next chunk).
    """

    sampling: SamplingParams
    base: int
    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    next_pos: int = 0
    output_index: int = 0

    def known(self, start: int, n: int) -> int:
        """How many of the n tokens from position `start` the worker already knows (a prefix)."""
        if start < self.base:
            return -1  # before what we know: cannot be a diff
        return max(0, min(n, self.base + len(self.tokens) - start))

    def tokens_at(self, start: int, n: int) -> list[int]:
        return self.tokens[start - self.base: start - self.base + n]

    def advance(self, chunk: SeqChunk) -> None:
        """Record that `chunk` was sent (tokens beyond the known ones are appended; draft
        tokens are not: see the module doc)."""
        n = len(chunk.token_ids) - chunk.num_draft_tokens
        if not chunk.is_ahead:     # its token comes with the batch before's output
            have = self.known(chunk.start_pos, n)
            self.tokens.extend(chunk.token_ids[have:n])
        self.block_table = list(chunk.block_table)
        self.next_pos = chunk.start_pos + n


def _full(chunk: SeqChunk) -> dict[str, Any]:
    d = {"r": chunk.req_id, "t": [] if chunk.is_ahead else list(chunk.token_ids), "p": chunk.start_pos,
         "b": list(chunk.block_table), "s": chunk.sample, "sp": chunk.sampling.to_dict(),
         "o": chunk.output_index}
    if chunk.is_ahead:
        d["a"] = 1
    if chunk.prior_token_ids is not None:
        d["h"] = list(chunk.prior_token_ids)
    if chunk.num_draft_tokens:
        d["k"] = chunk.num_draft_tokens
    return d


def _diff(st: SeqState, chunk: SeqChunk) -> dict[str, Any] | None:
    """The diff of `chunk` against `st`, or None when only a full entry can express it."""
    n = len(chunk.token_ids)
    d: dict[str, Any] = {"r": chunk.req_id, "n": n, "s": chunk.sample}
    if chunk.is_ahead:
        have = st.known(chunk.start_pos, 1)
        if have < 0 or (have == 0 and chunk.start_pos != st.base + len(st.tokens)):
            return None   # not right after the known tokens: the pending one would leave a hole
        d["a"] = 1
    else:
        have = st.known(chunk.start_pos, n)
        if have < 0 or st.tokens_at(chunk.start_pos, have) != chunk.token_ids[:have]:
            return None
        if have < n and chunk.start_pos + have != st.base + len(st.tokens):
            return None  # new tokens would leave a hole after the known ones
        if have < n:
            d["t"] = list(chunk.token_ids[have:])
    if chunk.start_pos != st.next_pos:
        d["p"] = chunk.start_pos
    old, new = st.block_table, chunk.block_table
    if new[:len(old)] == old:
        if len(new) > len(old):
            d["b+"] = list(new[len(old):])
    else:
        d["b"] = list(new)
    if chunk.output_index != st.output_index:
        d["o"] = chunk.output_index
    if chunk.num_draft_tokens:
        d["k"] = chunk.num_draft_tokens
    return d  # never "h": the worker's token history already covers what precedes the chunk


class _Mirror:
    """The per-request states shared by encoder and decoder logic."""

    def __init__(self) -> None:
        self.states: dict[str, SeqState] = {}

    def free(self, req_ids: list[str]) -> None:
        for r in req_ids:
            self.states.pop(r, None)

    def on_output(self, output: BatchOutput) -> None:
        """Append each sampled token (after the drafts accepted before it, whose K/V the
        chunk computed) to its request's known tokens."""
        for req_id, tok in output.sampled.items():
            st = self.states.get(req_id)
            if st is not None:
                acc = output.accepted.get(req_id)
                if acc:
                    st.tokens.extend(int(t) for t in acc)
                    st.next_pos += len(acc)
                    st.output_index += len(acc)
                st.tokens.append(int(tok))
                st.output_index += 1

    def _install(self, chunk: SeqChunk) -> None:
        # planned ahead: the pending token is not this mirror's to learn; the next one it learns
        # (this chunk's output) sits one position later
        base = chunk.start_pos + 1 if chunk.is_ahead else chunk.start_pos
        st = SeqState(chunk.sampling, base=base, output_index=chunk.output_index)
        st.advance(chunk)
        self.states[chunk.req_id] = st


class BatchEncoder(_Mirror):
    """Scheduler side. One encoder per worker connection; `reset()` starts a new epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch = uuid.uuid4().hex

    def reset(self) -> None:
        """Forget the mirror: the next batch sends every request in full."""
        self.states.clear()
        self.epoch = uuid.uuid4().hex

    def encode(self, batch: Batch) -> dict[str, Any]:
        self.free(batch.freed_req_ids)
        seqs = []
        for chunk in batch.seqs:
            st = self.states.get(chunk.req_id)
            d = _diff(st, chunk) if st is not None else None
            if d is None:
                seqs.append(_full(chunk))
                self._install(chunk)
            else:
                seqs.append(d)
                st.advance(chunk)
                st.output_index = chunk.output_index
        msg = {"op": "batch", "epoch": self.epoch, "batch_id": batch.batch_id,
               "seqs": seqs, "freed": list(batch.freed_req_ids)}
        if batch.kv_sends:
            msg["kv_sends"] = [k.to_wire() for k in batch.kv_sends]
        if batch.ahead:
            msg["ahead"] = True
        return msg


class BatchDecoder(_Mirror):
    """Worker side: rebuilds each Batch from full entries, diffs and the mirror."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch: str | None = None

    def new_epoch(self, epoch: str) -> list[str]:
        """Switch to `epoch` if it is new; returns the request ids forgotten by the switch."""
        if epoch == self.epoch:
            return []
        dropped = self.reset()
        self.epoch = epoch
        return dropped

    def reset(self) -> list[str]:
        """Forget every request and the epoch (the next batch must start a new one); returns
        the request ids forgotten."""
        dropped = list(self.states)
        self.states.clear()
        self.epoch = None
        return dropped

    def decode(self, msg: dict[str, Any]) -> Batch:
        """Rebuild the Batch. Raises UnknownRequestError (and changes nothing) for a diff that
        names a request with no state, so the encoder can resend everything in full."""
        freed = set(msg["freed"])  # freed first, as in encode(): a freed id is sent in full
        for d in msg["seqs"]:
            if "sp" not in d and (d["r"] not in self.states or d["r"] in freed):
                raise UnknownRequestError(d["r"])
        self.free(msg["freed"])
        return Batch(msg["batch_id"], [self._chunk(d) for d in msg["seqs"]], list(msg["freed"]),
                     [KvSend.from_wire(k) for k in msg.get("kv_sends") or ()], bool(msg.get("ahead", False)))

    def _chunk(self, d: dict[str, Any]) -> SeqChunk:
        if "sp" in d:
            tokens = [PENDING_TOKEN] if d.get("a") else list(d["t"])
            chunk = SeqChunk(d["r"], tokens, d["p"], list(d["b"]), d["s"],
                             SamplingParams.from_dict(d["sp"]), d["o"], d.get("h"), d.get("k", 0))
            self._install(chunk)
            return chunk
        st = self.states[d["r"]]
        start, n = d.get("p", st.next_pos), d["n"]
        have = st.known(start, n)
        if d.get("a"):   # planned ahead: the worker's own last token, if it was recorded yet
            tokens = st.tokens_at(start, 1) if have == 1 else [PENDING_TOKEN]
        else:
            tokens = st.tokens_at(start, have) + list(d.get("t", []))
        table = list(d["b"]) if "b" in d else st.block_table + list(d.get("b+", []))
        chunk = SeqChunk(d["r"], tokens, start, table, d["s"], st.sampling,
                         d.get("o", st.output_index), d.get("h"), d.get("k", 0))
        st.advance(chunk)
        st.output_index = chunk.output_index
        return chunk


# ---------------------------------------------------------------------------------------------
# framing: msgpack bytes, and the replies a worker sends
# ---------------------------------------------------------------------------------------------
def pack(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def output_reply(output: BatchOutput) -> dict[str, Any]:
    """A successful batch reply: sampled token ids and the worker's timings (seconds)."""
    return {"ok": True, **output.to_wire()}


def error_reply(kind: str, message: str) -> dict[str, Any]:
    """kind: "unknown_request" (resend in full) | "bad_request" | "execute_failed" | "unknown_op"."""
    return {"ok": False, "error": kind, "message": message}
