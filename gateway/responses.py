"""OpenAI response bodies: whole responses, SSE chunks, usage. Plain dicts (no validation cost
per streamed token)."""
from __future__ import annotations

import json
import time


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: dict | str) -> str:
    """One SSE event in OpenAI's framing: `data: <json>` and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


class ResponseShape:
    """Builds the bodies of one request. chat: chat.completion(.chunk) vs text_completion."""

    def __init__(self, req_id: str, model: str, chat: bool, include_usage: bool = False):
        self.id, self.model, self.chat, self.include_usage = req_id, model, chat, include_usage
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, text: str, finish_reason: str | None, prompt_tokens: int, completion_tokens: int) -> dict:
        """The non-streamed response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False) -> dict:
        """One streamed chunk. A chat stream's first chunk carries the assistant role."""
        if self.chat:
            delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        if self.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the final usage chunk
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
