"""The limits of one request that both the gateway and the scheduler check: token ids inside the
vocabulary, prompt + max_tokens inside the context window. Written once here; each caller keeps
its own wording (the gateway answers in OpenAI's). Torch-free.
"""
from __future__ import annotations

from typing import Iterable

from shared.sampling import InvalidRequestError


def check_token_ids(token_ids: Iterable, vocab_size: int, *, param: str = "prompt",
                    code: str | None = "invalid_token_id",
                    message: str = "prompt token ids must be integers in [0, {vocab_size})") -> None:
    """Raise InvalidRequestError(message, param, code) unless every id is an integer (numpy
    integers too) in [0, vocab_size). vocab_size <= 0 means unknown: no upper bound. Anything
    that is not a number is refused, not crashed on. message may name {vocab_size}."""
    try:
        ok = all(int(t) == t and 0 <= t < (vocab_size if vocab_size > 0 else t + 1) for t in token_ids)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise InvalidRequestError(message.format(vocab_size=vocab_size), param, code)


def check_context_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int, *,
                         param: str = "max_tokens",
                         message: str = "this model's maximum context length is {max_model_len} "
                                        "tokens, but {total} were requested ({num_prompt_tokens} in "
                                        "the prompt, {max_tokens} max_tokens)") -> None:
    """Raise InvalidRequestError(message, param, "context_length_exceeded") when the prompt plus
    the tokens to generate exceed the context window (all in tokens). message may name
    {max_model_len}, {total}, {num_prompt_tokens} and {max_tokens}."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            message.format(max_model_len=max_model_len, total=total,
                           num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens),
            param, "context_length_exceeded")


# --------------------------------------------------------------------------------------------
# Size bounds of one API request. The gateway states each in its OpenAPI schema (pydantic
# constraints in gateway.protocol) and answers a request over any of them with a 400 naming the
# field, while parsing the body: before tokenizing, rendering a template or compiling a grammar,
# so an oversized field costs the server no more than reading it. docs/api.md has the table.
# Characters are Unicode code points (what JSON strings hold); a schema's size is the length of
# its compact JSON text.
MAX_TEXT_CHARS = 1 << 20           # one prompt, or all chat messages' text together
MAX_PROMPT_TOKEN_IDS = 1 << 18     # one prompt given as token ids
# Commas and colons in a request body: bounds on its JSON values and object members, checked
# before parsing, since parsing holds the GIL for about 0.1 us per number and 1 us per member
# (those inside strings count too: text full of them is refused as well).
MAX_BODY_COMMAS = MAX_PROMPT_TOKEN_IDS + (1 << 14)
MAX_BODY_COLONS = 1 << 15
MAX_PROMPTS = 64                   # prompts of one /v1/completions call (and prompts x n)
MAX_MESSAGES = 2048                # chat messages of one call
MAX_CONTENT_PARTS = 256            # content parts of one message
MAX_NAME_CHARS = 256               # model, names, ids, labels
MAX_STOP = 16                      # entries of `stop` (strings or token ids)
MAX_STOP_CHARS = 1024              # one stop string
MAX_STOP_TOKEN_IDS = 256           # stop_token_ids
MAX_LOGIT_BIAS = 1024              # logit_bias entries
MAX_GUIDED_CHOICES = 1024          # entries of a choice constraint
MAX_GUIDED_CHOICE_CHARS = 1024     # one choice
MAX_REGEX_CHARS = 16 << 10         # a regex constraint
MAX_GRAMMAR_CHARS = 64 << 10       # a Lark / GBNF grammar
MAX_SCHEMA_CHARS = 64 << 10        # one JSON schema (response_format, guided_json, a tool's parameters)
MAX_TOOLS = 128                    # tools of one call
MAX_TOOLS_CHARS = 256 << 10        # all tools' definitions together
MAX_DESCRIPTION_CHARS = 8 << 10    # a tool's or a schema's description
MAX_TOOL_CALLS = 128               # tool calls of one assistant message
MAX_ARGUMENTS_CHARS = 64 << 10     # one tool call's arguments (JSON text)
MAX_METADATA = 16                  # metadata entries (keys <= 64, values <= 512 characters)
MAX_TOKENS = 1 << 20               # max_tokens / max_completion_tokens (the context caps it further)
