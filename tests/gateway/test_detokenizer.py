"""Incremental detokenization and stop strings, on the real SmolLM2 byte-level BPE."""
from __future__ import annotations

import pytest

from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = ["Hello, world!", " leading space", "日本語のテキスト", "emoji 🎉🇫🇷 mixed ü", "a\n\nb\tc", "  x  "]


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_text_equals_the_whole_decode_and_never_shows_a_broken_character(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"))
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_special_tokens_add_no_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    ids = tokenizer.encode("Hi", add_special_tokens=False) + tokenizer.eos_token_ids[:1]
    assert "".join(detok.add(t) for t in ids) + detok.flush() == "Hi"


def test_an_unfinished_character_is_released_only_by_flush(tokenizer):
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.flush() == "\ufffd"  # what is left of an incomplete character at the very end


def test_stop_string_split_over_deltas_is_found_and_not_emitted():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc", False)  # holds len("STOP") - 1 characters back
    assert m.feed("O") == (" ", False)
    assert m.feed("P and more") == ("", True)


def test_the_earliest_of_several_stop_strings_wins():
    m = StopStringMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", True)


def test_without_a_match_held_back_text_comes_out_at_flush():
    m = StopStringMatcher(["xyz"])
    out, hit = m.feed("abcxy")
    assert (out, hit) == ("abc", False)
    assert m.flush() == "xy"


def test_no_stop_strings_hold_nothing_back():
    assert StopStringMatcher([]).feed("abc") == ("abc", False)
