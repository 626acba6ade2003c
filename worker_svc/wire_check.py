"""What a worker accepts from the wire: a batch message is checked whole before it changes anything.

shared.wire.BatchDecoder applies a message entry by entry (frees, installs, advances mirrors)
and trusts its shape. `check_batch_message` runs first, on the message and a read-only view of
the mirror, and raises `WireCheckError` for anything the decoder or the model runner must not
see: wrong types, token ids outside the vocabulary, positions past the context window, block
ids outside the cache or a table too short for the chunk's positions, a request twice in one
batch, and KV sends of blocks that are not in the sending request's own block table (they would
export another request's KV). A refused message is answered "bad_request" and leaves the
decoder, the runner and the KV cache as they were.

Not refused here: a diff for a request the mirror does not hold (the decoder answers
"unknown_request" and the scheduler resends in full; that is protocol, not malformation), and
keys this module does not know (a newer scheduler may add fields; the decoder ignores them too).

Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from shared.config import cdiv
from shared.sampling import SamplingParams
from shared.wire import SeqState

MAX_ID_CHARS = 256          # request ids, epochs and addresses: longer is not ours
MAX_KV_TIMEOUT_S = 3600.0   # a KvSend's lease, seconds


class WireCheckError(ValueError):
    """A malformed batch message (the reply is "bad_request")."""


@dataclass(frozen=True)
class WireLimits:
    """A worker's limits, from its ModelInfo. num_blocks 0 or vocab_size 0: unknown (no upper
    bound on block ids or token ids; a stand-in runner without a cache)."""

    max_model_len: int
    block_size: int
    num_blocks: int = 0
    vocab_size: int = 0

    @classmethod
    def of(cls, model_info: Any) -> "WireLimits":
        return cls(int(model_info.max_model_len), int(getattr(model_info, "block_size", 16) or 16),
                   int(getattr(model_info, "num_blocks", 0) or 0), int(getattr(model_info, "vocab_size", 0) or 0))


def _int(v: Any) -> bool:
    return type(v) is int   # msgpack decodes integers as int; bool is not a count


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_ID_CHARS:
        raise WireCheckError(f"{what} must be a string of 1..{MAX_ID_CHARS} characters")
    return v


def _ids(v: Any, what: str, upper: int, *, empty: bool = True) -> list[int]:
    """A list of ints in [0, upper) (upper 0: no upper bound)."""
    if not isinstance(v, list) or not (empty or v) or not all(type(x) is int for x in v):
        raise WireCheckError(f"{what} must be a list of integers")
    if v and (min(v) < 0 or (upper > 0 and max(v) >= upper)):
        raise WireCheckError(f"{what} holds ids outside [0, {upper or 'inf'})")
    return v


def _count(v: Any, what: str, lo: int = 0) -> int:
    if not _int(v) or v < lo:
        raise WireCheckError(f"{what} must be an integer >= {lo}")
    return v


def check_batch_message(msg: Any, states: Mapping[str, SeqState], limits: WireLimits) -> None:
    """Raise WireCheckError unless `msg` is a well-formed batch whose every chunk fits `limits`,
    given `states` (the decoder's mirror as this message will find it: empty for a new epoch).
    Reads `states`, never changes them."""
    if not isinstance(msg, dict):
        raise WireCheckError("a batch message must be a map")
    _str(msg.get("epoch"), "epoch")
    if not _int(msg.get("batch_id")):
        raise WireCheckError("batch_id must be an integer")
    seqs, freed = msg.get("seqs"), msg.get("freed")
    if not isinstance(seqs, list) or not isinstance(freed, list):
        raise WireCheckError("seqs and freed must be lists")
    freed_ids = {_str(r, "a freed request id") for r in freed}
    tables: dict[str, list[int] | None] = {}   # None: unknown to the mirror
    for d in seqs:
        if not isinstance(d, dict):
            raise WireCheckError("a seq entry must be a map")
        rid = _str(d.get("r"), "a request id")
        if rid in tables:
            raise WireCheckError(f"request {rid!r} appears twice in one batch")
        st = states.get(rid) if rid not in freed_ids else None
        if "sp" not in d and st is None:
            tables[rid] = None    # the decoder answers unknown_request: nothing to check
            continue
        tables[rid] = _check_chunk(d, None if "sp" in d else st, limits)   # a full entry stands alone
    _check_kv_sends(msg.get("kv_sends"), tables, limits)


def _check_chunk(d: dict, st: SeqState | None, limits: WireLimits) -> list[int]:
    """Check one seq entry (full when st is None); returns its block table after the batch."""
    rid = d["r"]
    if not isinstance(d.get("s"), bool):
        raise WireCheckError(f"request {rid!r}: the sample flag must be a boolean")
    vocab, nblk = limits.vocab_size, limits.num_blocks
    if st is None:
        tokens = _ids(d.get("t"), f"request {rid!r}: tokens", vocab)
        start = _count(d.get("p"), f"request {rid!r}: start position")
        table = _ids(d.get("b"), f"request {rid!r}: block table", nblk)
        _count(d.get("o"), f"request {rid!r}: output index")
        if d.get("h") is not None:
            _ids(d["h"], f"request {rid!r}: prior tokens", vocab)
        if not isinstance(d.get("sp"), dict):
            raise WireCheckError(f"request {rid!r}: sampling parameters must be a map")
        try:
            SamplingParams.from_dict(d["sp"])
        except (TypeError, ValueError) as e:
            raise WireCheckError(f"request {rid!r}: bad sampling parameters: {e}") from None
        n = len(tokens)
        if d.get("a"):   # a decode planned ahead: its one token is pending
            if tokens:
                raise WireCheckError(f"request {rid!r}: a decode planned ahead carries no token")
            n = 1
    else:
        n = _count(d.get("n"), f"request {rid!r}: chunk length", 1)
        start = _count(d.get("p", st.next_pos), f"request {rid!r}: start position")
        new = _ids(d.get("t", []), f"request {rid!r}: tokens", vocab)
        have = st.known(start, n)
        if d.get("a"):   # a decode planned ahead: one pending token, right after the known ones
            if n != 1 or new or have < 0 or (have == 0 and start != st.base + len(st.tokens)):
                raise WireCheckError(f"request {rid!r}: a decode planned ahead must be one pending "
                                     "token right after the tokens the worker holds")
        elif (have < 0 or have + len(new) != n
                or (new and start + have != st.base + len(st.tokens))):   # new tokens after a hole
            raise WireCheckError(f"request {rid!r}: the diff's tokens do not continue what the worker holds")
        if "b" in d:
            table = _ids(d["b"], f"request {rid!r}: block table", nblk)
        else:
            table = st.block_table + _ids(d.get("b+", []), f"request {rid!r}: appended blocks", nblk)
        _count(d.get("o", st.output_index), f"request {rid!r}: output index")
    if n < 1:
        raise WireCheckError(f"request {rid!r}: an empty chunk")
    end = start + n
    if end > limits.max_model_len:
        raise WireCheckError(f"request {rid!r}: positions up to {end} exceed max_model_len {limits.max_model_len}")
    if len(table) < cdiv(end, limits.block_size):
        raise WireCheckError(f"request {rid!r}: {len(table)} blocks cannot hold {end} tokens")
    return table


def _check_kv_sends(sends: Any, tables: dict[str, list[int] | None], limits: WireLimits) -> None:
    """A KvSend may export only blocks of its own request's table, as it stands after this batch."""
    if sends is None:
        return
    if not isinstance(sends, list):
        raise WireCheckError("kv_sends must be a list")
    for k in sends:
        if not isinstance(k, dict):
            raise WireCheckError("a kv_send must be a map")
        rid = _str(k.get("req_id"), "a kv_send's request id")
        src = _ids(k.get("src_blocks"), f"kv_send of {rid!r}: src_blocks", limits.num_blocks, empty=False)
        dst = _ids(k.get("dst_blocks"), f"kv_send of {rid!r}: dst_blocks", 0, empty=False)
        _str(k.get("dst_address"), f"kv_send of {rid!r}: dst_address")
        timeout = k.get("timeout_s", 10.0)
        if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                or not 0 < timeout <= MAX_KV_TIMEOUT_S):
            raise WireCheckError(f"kv_send of {rid!r}: timeout_s must be in (0, {MAX_KV_TIMEOUT_S:g}]")
        if len(src) != len(dst):
            raise WireCheckError(f"kv_send of {rid!r}: src_blocks and dst_blocks differ in length")
        if rid in tables and tables[rid] is None:
            continue      # its request is unknown: the whole batch is answered unknown_request
        if rid not in tables or not set(tables[rid]).issuperset(src):
            raise WireCheckError(f"kv_send of {rid!r}: blocks that are not in that request's table "
                                 "of this batch")
