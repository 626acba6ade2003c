"""What the served OpenAPI document says about responses, so that it tells the truth: the
OpenAI error shape for every error status a route can answer, the `text/event-stream` body of
streamed calls beside the JSON one, the bodies of success responses, and no FastAPI 422 (a body
that does not validate is a 400 here, gateway.errors). The request bodies' constraints are the
pydantic models' (gateway.protocol). Documentation only: responses are plain dicts, never
validated against these models on the way out (no cost per request)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None


class ChatCompletion(_Open):
    """A whole chat answer (stream: false). Streamed, the body is text/event-stream: `data:
    <chat.completion.chunk JSON>` events, then `data: [DONE]`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort"] | None


class Completion(_Open):
    """A whole completion (stream: false). Streamed: text/event-stream of text_completion
    chunks, then `data: [DONE]`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Readiness(_Open):
    status: str


_RETRY = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}}
_ERRORS = {
    400: "invalid parameters (param names the first one), invalid JSON, a context length exceeded",
    401: "missing or wrong API key (when the server has one)",
    404: "the model is not the one served (code model_not_found)",
    413: "the request body is over the size limit",
    429: "the request queue is full (code queue_full)",
    500: "the generation failed (code generation_error); streamed, an error event then [DONE]",
    503: "the queue is unavailable or the server is draining",
}


def errors(*statuses: int) -> dict[int | str, dict]:
    """The `responses` entries of these error statuses, each in the OpenAI error shape."""
    out: dict[int | str, dict] = {}
    for s in statuses:
        out[s] = {"model": ErrorResponse, "description": _ERRORS[s]}
        if s in (429, 503):
            out[s]["headers"] = _RETRY
    return out


# One server-sent event of a stream (OpenAPI 3.0/3.1 put the per-event schema under `schema`, as
# 3.2's itemSchema does, and schemathesis validates every parsed event against it): `data` is a
# chunk's JSON, an error object's JSON, or the final "[DONE]".
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": "a chunk as JSON, or [DONE]"},
                            "event": {"type": "string"}, "id": {"type": "string"},
                            "retry": {"type": "integer"}}}


def generation(model: type[BaseModel]) -> dict[int | str, dict]:
    """The responses of a generation endpoint: JSON or SSE, and its errors."""
    return {200: {"model": model, "description": "the answer (JSON), or the SSE stream when stream is true",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}},
            **errors(400, 401, 404, 413, 429, 500, 503)}


def without_422(schema: dict) -> dict:
    """Drop FastAPI's automatic 422 responses (validation errors are 400s here) and their
    component schemas."""
    for path in schema.get("paths", {}).values():
        for op in path.values():
            if isinstance(op, dict):
                op.get("responses", {}).pop("422", None)
    comps = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    return schema
