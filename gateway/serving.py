"""The two generation endpoints: validate, tokenize, admit (or reject: nothing is queued for a
rejected request), then answer as SSE or as one JSON body."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from gateway.errors import APIError
from gateway.generation import Dispatcher, Generation
from gateway.metrics import GatewayMetrics
from gateway.protocol import ChatCompletionRequest, CompletionRequest, _GenerationFields
from gateway.responses import SSE_DONE, ResponseShape, sse
from shared.config import ModelInfo
from shared.messages import RequestMsg
from shared.queue import GatewayQueue
from shared.sampling import InvalidRequestError


@dataclass
class ServingConfig:
    """model_name: the name /v1/models lists and responses carry.
    max_queue_depth: requests queued and not yet taken by a scheduler; at or above it new
        requests get 429 with Retry-After: retry_after_s (seconds).
    default_max_tokens: tokens generated when the request names no max_tokens (capped by what
        is left of the context).
    event_timeout_s: seconds without any event before a request ends with an error (None:
        wait forever)."""

    model_name: str
    max_queue_depth: int = 1024
    default_max_tokens: int = 256
    retry_after_s: int = 1
    event_timeout_s: float | None = 600.0


class Serving:
    def __init__(self, tokenizer, model_info: ModelInfo, queue: GatewayQueue, dispatcher: Dispatcher,
                 metrics: GatewayMetrics, cfg: ServingConfig):
        self.tok, self.info, self.queue = tokenizer, model_info, queue
        self.dispatcher, self.metrics, self.cfg = dispatcher, metrics, cfg
        self._end_ids = set(model_info.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", []))
        self._closers: set[asyncio.Task] = set()  # keeps background close() tasks referenced

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.time()
        body.check_supported()
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = await asyncio.to_thread(self.tok.encode, prompt)
        else:
            prompt_ids = self._checked_ids(prompt)
        return await self._serve(body, prompt_ids, "prompt", False, arrival, request)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.time()
        body.check_supported()
        try:
            prompt_ids = await asyncio.to_thread(self._encode_chat, body.template_messages())
        except InvalidRequestError:
            raise
        except Exception as exc:  # the template's own raise_exception (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
        return await self._serve(body, prompt_ids, "messages", True, arrival, request)

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        if hasattr(self.tok, "encode_chat"):  # shared.tokenizer: no second BOS after the template's
            return self.tok.encode_chat(messages)
        return self.tok.encode(self.tok.apply_chat_template(messages))

    def _checked_ids(self, ids: list[int]) -> list[int]:
        if any(not 0 <= t < self.info.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.info.vocab_size})", "prompt")
        return list(ids)

    def _max_tokens(self, body: _GenerationFields, num_prompt: int, prompt_param: str) -> int:
        """The max_tokens to run with; raises context_length_exceeded when it cannot fit."""
        limit, asked = self.info.max_model_len, body.requested_max_tokens()
        if asked is not None:
            body.sampling(asked)  # validate the value itself first (e.g. max_tokens=0)
        room = limit - num_prompt
        if asked is None and room >= 1:
            return min(self.cfg.default_max_tokens, room)
        if asked is None or asked > room:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but the request "
                           f"has {num_prompt} prompt tokens and asks for {asked or 1} more.",
                           param="max_tokens" if asked is not None and room >= 1 else prompt_param,
                           code="context_length_exceeded")
        return asked

    async def _admit(self) -> None:
        try:
            depth = await self.queue.depth()
        except Exception as exc:  # noqa: BLE001 - the queue is down: say so, queue nothing
            raise APIError(503, f"the request queue is unavailable: {exc}", code="queue_unavailable") from exc
        if depth >= self.cfg.max_queue_depth:
            raise APIError(429, f"the server is busy ({depth} requests queued); retry later",
                           code="queue_full", headers={"Retry-After": str(self.cfg.retry_after_s)})

    async def _serve(self, body: _GenerationFields, prompt_ids: list[int], prompt_param: str, chat: bool,
                     arrival: float, request: Request) -> Response:
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", prompt_param)
        sampling = body.sampling(self._max_tokens(body, len(prompt_ids), prompt_param))
        await self._admit()
        req_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        req = RequestMsg(req_id, prompt_ids, sampling, self.queue.gateway_id, arrival)
        gen = Generation(req, tokenizer=self.tok, queue=self.queue, dispatcher=self.dispatcher,
                         metrics=self.metrics, stop=body.stop_strings(),
                         end_token_ids=self._end_ids | set(sampling.stop_token_ids),
                         event_timeout_s=self.cfg.event_timeout_s)
        try:
            await gen.start()
        except Exception as exc:  # noqa: BLE001
            raise APIError(503, f"could not queue the request: {exc}", code="queue_unavailable") from exc
        shape = ResponseShape(req_id, self.cfg.model_name, chat, body.include_usage)
        if body.stream:
            return StreamingResponse(self._stream(gen, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(gen.close))
        return await self._whole(gen, shape, request)

    async def _stream(self, gen: Generation, shape: ResponseShape):
        """SSE body. On a client disconnect Starlette cancels this generator and then runs the
        response's background task, gen.close(), which sends the abort."""
        try:
            if shape.chat:
                yield sse(shape.chunk("", first=True))
            async for d in gen.deltas():
                if d.finish_reason == "error":
                    err = APIError(500, d.error or "generation failed", type="server_error", code="generation_error")
                    yield sse(err.body())
                    yield SSE_DONE
                    return
                if d.text or d.finish_reason:
                    yield sse(shape.chunk(d.text, d.finish_reason))
            if shape.include_usage:
                yield sse(shape.usage_chunk(len(gen.req.prompt_token_ids), gen.num_tokens))
            yield SSE_DONE
        finally:
            self._spawn_close(gen)  # also covers a generator closed without the background task

    async def _whole(self, gen: Generation, shape: ResponseShape, request: Request) -> Response:
        async def collect() -> list[str]:
            return [d.text async for d in gen.deltas()]

        collecting = asyncio.ensure_future(collect())
        disconnect = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collecting, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():  # the client left: nobody will read the answer
                collecting.cancel()
                return Response(status_code=499)
            parts = collecting.result()
        finally:
            disconnect.cancel()
            await gen.close()
        if gen.finish_reason == "error":
            raise APIError(500, gen.error or "generation failed", type="server_error", code="generation_error")
        return JSONResponse(shape.full("".join(parts), gen.finish_reason,
                                       len(gen.req.prompt_token_ids), gen.num_tokens))

    def _spawn_close(self, gen: Generation) -> None:
        task = asyncio.ensure_future(gen.close())
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body was already read, so the next ASGI
    message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
