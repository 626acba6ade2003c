"""OpenAI response bodies: whole responses, SSE chunks, usage, logprobs. Plain dicts (no
validation cost per streamed token)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: dict | str) -> str:
    """One SSE event in OpenAI's framing: `data: <json>` and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


@dataclass
class TokenLogprob:
    """One generated token's logprob and its top alternatives [[token id, logprob], ...]."""

    token_id: int
    logprob: float
    top: list[list]


class LogprobFormat:
    """Token ids -> OpenAI's two logprobs shapes. token_str(id) is the token's text."""

    def __init__(self, token_str: Callable[[int], str]):
        self.token_str = token_str

    def chat(self, entries: list[TokenLogprob]) -> dict:
        """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]} (chat)."""
        def one(tid: int, lp: float) -> dict:
            s = self.token_str(tid)
            return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode())}

        return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries]}

    def completion(self, entries: list[TokenLogprob], text_offset: int) -> dict:
        """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} (completions);
        text_offset: characters of the choice's text before the first entry."""
        tokens, offsets = [], []
        for e in entries:
            s = self.token_str(e.token_id)
            tokens.append(s)
            offsets.append(text_offset)
            text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for e in entries],
                "top_logprobs": [{self.token_str(t): _finite(lp) for t, lp in e.top} for e in entries],
                "text_offset": offsets}


def _finite(lp: float) -> float:
    """JSON has no -inf: a token with probability 0 (masked) gets the lowest float instead."""
    return lp if lp > -1e30 else -9999.0


class ResponseShape:
    """Builds the bodies of one request. chat: chat.completion(.chunk) vs text_completion."""

    def __init__(self, req_id: str, model: str, chat: bool, include_usage: bool = False):
        self.id, self.model, self.chat, self.include_usage = req_id, model, chat, include_usage
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None,
               tool_calls: list[dict] | None = None) -> dict:
        """One choice of the non-streamed response (chat: with tool_calls when the model called
        tools; content is then None unless it also wrote text)."""
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def full(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        """The non-streamed response (choices from choice())."""
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False, index: int = 0,
              logprobs: dict | None = None) -> dict:
        """One streamed chunk of choice `index`. A chat stream's first chunk carries the role."""
        if self.chat:
            delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        if self.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the final usage chunk
        return body

    def delta_chunk(self, delta: dict, finish_reason: str | None = None, *, index: int = 0,
                    logprobs: dict | None = None) -> dict:
        """One streamed chat chunk with a given delta (content and / or tool_calls fragments)."""
        body = self._envelope("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": logprobs,
                                                          "finish_reason": finish_reason}])
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
