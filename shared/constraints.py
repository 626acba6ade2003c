"""Output constraints (structured outputs): the API's forms -> one llguidance grammar.

A request may constrain its output to a JSON schema (`response_format` json_schema), to any
JSON object (json_object), to a regex, to one of a list of strings (choice), or to a grammar
(Lark, or llama.cpp's GBNF). Every form becomes one llguidance grammar (a JSON string: what
`llguidance.LLMatcher` takes), carried in SamplingParams.constraint to the worker, which builds
one matcher per request from it (worker_svc.sampling.guided).

JSON output has no free whitespace: items are separated by ", " and keys by ": " (as Python's
json.dumps), so a model cannot fill max_tokens with blanks (the "whitespace loop" of
vllm#38696 / xgrammar#212) and the output is one line.

`check_grammar` compiles a grammar against the model's tokenizer (about 1 ms for a JSON schema):
the gateway calls it so a bad schema is a 400 naming the parameter, never a failed batch.

Compiles and matchers run under explicit resource limits (`parser_limits`, the same in the
gateway's check and in the worker's matchers, so a grammar the gateway accepts is one the worker
can run); their error messages leave out the parser's internal state.

Torch-free (llguidance has no dependencies).
"""
from __future__ import annotations

import json
import threading
from typing import Any

from shared.sampling import InvalidRequestError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

# llguidance's resource limits, written out rather than left to the library's defaults (these
# are its documented defaults). Fuel is work units (about 50k per ms building the lexer, 14k per
# ms in one mask step); a lexer state costs 1-2 kB; grammar size counts symbols.
PARSER_LIMITS = {
    "max_items_in_row": 2000,          # branching of one production row
    "initial_lexer_fuel": 1_000_000,   # building the lexer's regexes (~20 ms)
    "step_lexer_fuel": 200_000,        # one token mask (~14 ms)
    "step_max_items": 50_000,          # Earley items of one mask step
    "max_lexer_states": 250_000,       # lexer states of one matcher (memory)
    "max_grammar_size": 500_000,       # symbols of the grammar's productions
}


def parser_limits():
    """llguidance.LLParserLimits of PARSER_LIMITS, with terse errors (no parser state in them)."""
    import llguidance

    return llguidance.LLParserLimits(**PARSER_LIMITS, verbose_errors=False)


def grammar_for(kind: str, value: Any, param: str) -> str:
    """The llguidance grammar of one constraint. kind: one of KINDS; value: the schema (dict or
    JSON text), the regex, the list of strings, the Lark / GBNF text (None for json_object).
    Raises InvalidRequestError naming `param` when the value is malformed (compile errors are
    check_grammar's)."""
    import llguidance

    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if kind == "json_schema":
            schema = json.loads(value) if isinstance(value, str) else value
            if isinstance(schema, bool):
                schema = {} if schema else {"not": {}}
            if not isinstance(schema, dict):
                raise InvalidRequestError("the JSON schema must be an object", param)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if kind == "regex":
            if not isinstance(value, str) or not value:
                raise InvalidRequestError("the regex must be a non-empty string", param)
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            if (not isinstance(value, list) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise InvalidRequestError("choice must be a non-empty list of non-empty strings", param)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in value))
        if kind == "grammar":
            if not isinstance(value, str) or not value.strip():
                raise InvalidRequestError("the grammar must be a non-empty string", param)
            return llguidance.grammar_from("grammar", value)   # Lark, or GBNF converted to Lark
    except InvalidRequestError:
        raise
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"invalid {kind}: {exc}", param) from exc
    raise InvalidRequestError(f"unknown constraint kind {kind!r}", param)


def check_grammar(grammar: str, ll_tokenizer, param: str) -> None:
    """Compile `grammar` against the tokenizer; InvalidRequestError naming `param` if it fails
    (unsupported schema keyword, bad regex, grammar syntax, resource limits)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer, limits=parser_limits())
    if error:
        raise InvalidRequestError(f"{param} cannot be compiled: {error.strip()[:500]}", param)


def ll_tokenizer(tokenizer, vocab_size: int | None = None):
    """The llguidance tokenizer of a shared.tokenizer.Tokenizer (its `tokenizers` backend and
    EOS ids), masks `vocab_size` wide (the logits' width: >= the tokenizer's, padded
    vocabularies). About 0.4 s for a 49k vocabulary: cached per tokenizer and width."""
    import llguidance

    key = (id(tokenizer), vocab_size or tokenizer.vocab_size)
    with _lock:
        hit = _cache.get(key)
        if hit is None or hit[0] is not tokenizer:
            llt = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=key[1],
                                         eos_token=list(tokenizer.eos_token_ids) or None)
            hit = _cache[key] = (tokenizer, llt)    # the tokenizer is kept: its id stays unique
        return hit[1]


_cache: dict[tuple[int, int], tuple[Any, Any]] = {}
_lock = threading.Lock()
