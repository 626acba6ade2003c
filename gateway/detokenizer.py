"""Token ids -> text, one token at a time, emitting only text that can no longer change; and
stop strings, matched across token boundaries.

Why incremental decoding needs care: with byte-level BPE one character (e.g. an emoji) can be
spread over several tokens, and decoding a prefix yields U+FFFD for the incomplete bytes; and
some tokenizers drop a token's leading space when it is decoded alone. So each step decodes a
short window of ids with some left context, and text is released only once it no longer ends
in U+FFFD (the approach of vLLM and TGI).
"""
from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens kept as left context of the first generated token


class IncrementalDetokenizer:
    """Invariant: the concatenation of everything `add` and `flush` returned equals
    decode(generated ids) (skip_special_tokens=True), except that a trailing incomplete
    character is released only by `flush`."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0                 # start of the decode window in _ids
        self._read = len(self._ids)      # ids before this are already released as text

    def add(self, token_id: int) -> str:
        """Append one generated token; return the newly stable text (maybe "")."""
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""  # nothing visible yet, or a multi-byte character still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text):]

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text):]


class StopStringMatcher:
    """Holds back the last (longest stop - 1) characters so that a stop string split over
    several deltas is still found; the stop string itself is never emitted (OpenAI's rule)."""

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string matched). After a match,
        the text after the stop string is discarded."""
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            out, self._pending = self._pending[:min(hits)], ""
            return out, True
        cut = max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """At the end without a match: the held-back text."""
        out, self._pending = self._pending, ""
        return out
