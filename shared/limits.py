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
