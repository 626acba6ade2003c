"""The two generation endpoints: validate, tokenize, admit (or reject: nothing is queued for a
rejected request), then answer as SSE or as one JSON body.

One API call may ask for several choices (`n`, and a list of prompts on /v1/completions):
choice i * n + j is choice j of prompt i, each its own request to the scheduler (`<id>`, then
`<id>-<k>`), each with its own seed stream (seed + j when the client gave a seed; else the
scheduler derives one from the request id). Choices 1..n-1 of a prompt name choice 0 in
`share_prompt_with`, so a scheduler that holds both computes the prompt's KV once."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from gateway.errors import APIError
from gateway.generation import Dispatcher, Generation
from gateway.metrics import GatewayMetrics
from gateway.preprocess import PreprocessConfig, Preprocessor
from gateway.protocol import ChatCompletionRequest, CompletionRequest, _GenerationFields
from gateway.responses import SSE_DONE, LogprobFormat, ResponseShape, TokenLogprob, sse
from gateway.streaming import TimedStreamingResponse
from gateway.tools import ToolPlan, fallback_system_prompt, parser_for_template, required_schema, template_has_tools
from shared.config import ModelInfo
from shared.constraints import check_grammar, grammar_for, ll_tokenizer
from shared.limits import check_context_length, check_token_ids
from shared.messages import RequestMsg
from shared.queue import GatewayQueue
from shared.sampling import InvalidRequestError
from shared.tokenizer import ChatTemplateError

log = logging.getLogger(__name__)
# Work this small (well under a millisecond) is done on the event loop: the trip to the
# preprocessing pool would cost more than the work. Anything larger goes to the pool.
INLINE_CHARS = 2048      # a prompt's or a chat's text, in characters
INLINE_MESSAGES = 16     # a chat's messages (and no tools)


@dataclass
class ServingConfig:
    """model_name: the name /v1/models lists and responses carry.
    max_queue_depth: requests queued and not yet taken by a scheduler; at or above it new
        requests get 429 with Retry-After: retry_after_s (seconds).
    default_max_tokens: tokens generated when the request names no max_tokens (capped by what
        is left of the context).
    event_timeout_s: seconds without any event before a request ends with an error (None:
        wait forever).
    sse_send_timeout_s: seconds one SSE write may wait for a client that does not read; past
        it the stream is dropped and the request aborted (gateway.streaming; None: no bound).
    aliases: other model names accepted in requests (besides model_name); any other name
        gets 404 model_not_found. A request without a model gets model_name.
    parse_control_tokens: control tokens spelled in chat messages are control tokens (trusted
        clients only); False: they are text, only the chat template writes control tokens.
    preprocess: the bounded pool that tokenizes, renders templates and compiles grammars."""

    model_name: str
    aliases: tuple[str, ...] = ()
    max_queue_depth: int = 1024
    default_max_tokens: int = 256
    retry_after_s: int = 1
    event_timeout_s: float | None = 600.0
    sse_send_timeout_s: float | None = 30.0
    parse_control_tokens: bool = False
    preprocess: PreprocessConfig = dataclasses.field(default_factory=PreprocessConfig)


class Serving:
    def __init__(self, tokenizer, model_info: ModelInfo, queue: GatewayQueue, dispatcher: Dispatcher,
                 metrics: GatewayMetrics, cfg: ServingConfig):
        self.tok, self.info, self.queue = tokenizer, model_info, queue
        self.dispatcher, self.metrics, self.cfg = dispatcher, metrics, cfg
        self._end_ids = set(model_info.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", []))
        self._closers: set[asyncio.Task] = set()  # keeps background close() tasks referenced
        self.active: set[Generation] = set()       # started and not yet closed (drain waits on it)
        self.draining = False                      # SIGTERM: new requests get 503
        self.logprob_format = LogprobFormat(functools.lru_cache(maxsize=65536)(self._token_str))
        self.pre = Preprocessor(cfg.preprocess)
        self._max_token_chars = _longest_token(tokenizer)
        if hasattr(tokenizer, "warm"):
            tokenizer.warm()   # not on a request's event-loop turn

    def _check_text_fits(self, chars: int, param: str) -> None:
        """A text of `chars` characters needs at least chars / _max_token_chars tokens: when that
        is over the context length, refuse it without tokenizing it."""
        if chars > self.info.max_model_len * self._max_token_chars:
            raise InvalidRequestError(f"This model's maximum context length is {self.info.max_model_len} "
                                      f"tokens, and the {param} ({chars} characters) is longer than that",
                                      param, "context_length_exceeded")

    def _token_str(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def check_model(self, name: str | None) -> None:
        """404 model_not_found (OpenAI's shape) for a model this server does not serve."""
        if name is not None and name != self.cfg.model_name and name not in self.cfg.aliases:
            raise APIError(404, f"The model `{name}` does not exist (this server serves "
                           f"`{self.cfg.model_name}`).", param="model", code="model_not_found",
                           type="invalid_request_error")

    def _check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica",
                           code="server_shutting_down", headers={"Retry-After": str(self.cfg.retry_after_s)})

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.time()
        self._check_accepting()
        self.check_model(body.model)
        body.check_supported()
        prompts = []
        for p in body.prompts():
            if isinstance(p, str):
                self._check_text_fits(len(p), "prompt")
                prompts.append(self.tok.encode(p) if len(p) <= INLINE_CHARS
                               else await self.pre.run("tokenizing the prompt", self.tok.encode, p))
            else:
                prompts.append(self._checked_ids(p))
        grammar = await self._grammar(body.constraint())
        return await self._serve(body, prompts, "prompt", False, arrival, request, grammar)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.time()
        self._check_accepting()
        self.check_model(body.model)
        body.check_supported()
        plan, messages, tools = self._tool_plan(body)
        chars = sum(len(m["content"] or "") for m in messages)
        self._check_text_fits(chars, "messages")
        try:
            if chars <= INLINE_CHARS and len(messages) <= INLINE_MESSAGES and not tools:
                prompt_ids = self._encode_chat(messages, tools)
            else:
                prompt_ids = await self.pre.run("rendering the chat template", self._encode_chat, messages, tools)
        except (InvalidRequestError, APIError):
            raise
        except ChatTemplateError as exc:  # the template's own raise_exception (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
        except Exception as exc:
            log.exception("the chat template failed on a request's messages")
            raise APIError(400, "the chat template could not render these messages", param="messages") from exc
        constraint = body.constraint()
        if plan is not None and plan.mode == "required":
            constraint = ("json_schema", required_schema(plan.tools, body.parallel_tool_calls is not False), "tools")
        elif plan is not None and plan.mode == "named":
            fn = next(t["function"] for t in plan.tools if t["function"]["name"] == plan.name)
            constraint = ("json_schema", fn.get("parameters") or {"type": "object", "properties": {}}, "tools")
        grammar = await self._grammar(constraint)
        return await self._serve(body, [prompt_ids], "messages", True, arrival, request, grammar, plan)

    def _tool_plan(self, body: ChatCompletionRequest) -> tuple[ToolPlan | None, list[dict], list[dict] | None]:
        """(how the request uses tools or None, the messages for the template, the tools the
        template renders itself or None). A template without tool support gets the tools in a
        system message (gateway.tools.FALLBACK_PROMPT) and earlier calls as <tool_call> text."""
        template = getattr(self.tok, "chat_template", None)
        native = template_has_tools(template)
        messages = body.template_messages(tool_calls_as_text=not native)
        mode = body.tool_mode()
        if mode == "none":
            return None, messages, None
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        name = body.tool_choice.function.name if mode == "named" else None
        plan = ToolPlan(mode, tools, name, parser_for_template(template) if mode == "auto" else None)
        if native:
            return plan, messages, tools
        prompt = fallback_system_prompt(tools)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{prompt}\n\n{messages[0]['content']}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
        return plan, messages, None

    async def _grammar(self, constraint: tuple | None) -> str | None:
        """The llguidance grammar of (kind, value, parameter), compiled once against the
        tokenizer here (about 1 ms; the first call builds the grammar tokenizer, ~0.5 s) so a
        bad one is a 400 naming the parameter, not a failed batch."""
        if constraint is None:
            return None
        kind, value, param = constraint

        def compile_() -> str:
            grammar = grammar_for(kind, value, param)
            check_grammar(grammar, ll_tokenizer(self.tok), param)
            return grammar

        return await self.pre.run(f"compiling {param}", compile_)

    def _encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if hasattr(self.tok, "encode_chat"):  # shared.tokenizer: no second BOS after the template's
            return self.tok.encode_chat(messages, tools=tools, parse_control_tokens=self.cfg.parse_control_tokens)
        return self.tok.encode(self.tok.apply_chat_template(messages, tools=tools))

    def _checked_ids(self, ids: list[int]) -> list[int]:
        check_token_ids(ids, self.info.vocab_size, code=None,
                        message="prompt token ids must be in [0, {vocab_size})")
        return list(ids)

    def _max_tokens(self, body: _GenerationFields, num_prompt: int, prompt_param: str) -> int:
        """The max_tokens to run with; raises context_length_exceeded when it cannot fit (without
        max_tokens: when not even one token fits)."""
        limit, asked = self.info.max_model_len, body.requested_max_tokens()
        if asked is not None:
            body.sampling(asked)  # validate the value itself first (e.g. max_tokens=0)
        room = limit - num_prompt
        check_context_length(num_prompt, asked or 1, limit,
                             param="max_tokens" if asked is not None and room >= 1 else prompt_param,
                             message="This model's maximum context length is {max_model_len} tokens, "
                                     "but the request has {num_prompt_tokens} prompt tokens and asks "
                                     "for {max_tokens} more.")
        return min(self.cfg.default_max_tokens, room) if asked is None else asked

    async def _admit(self) -> None:
        try:
            depth = await self.queue.depth()
        except Exception as exc:  # noqa: BLE001 - the queue is down: say so, queue nothing
            log.warning("queue depth check failed: %r", exc)
            raise APIError(503, "the request queue is unavailable", code="queue_unavailable",
                           headers={"Retry-After": str(self.cfg.retry_after_s)}) from exc
        if depth >= self.cfg.max_queue_depth:
            raise APIError(429, f"the server is busy ({depth} requests queued); retry later",
                           code="queue_full", headers={"Retry-After": str(self.cfg.retry_after_s)})

    async def _serve(self, body: _GenerationFields, prompts: list[list[int]], prompt_param: str, chat: bool,
                     arrival: float, request: Request, grammar: str | None = None,
                     plan: ToolPlan | None = None) -> Response:
        for ids in prompts:
            if not ids:
                raise InvalidRequestError("the prompt is empty", prompt_param)
        bias = body.logit_bias_pairs(self.info.vocab_size)
        samplings = [body.sampling(self._max_tokens(body, len(ids), prompt_param), grammar, bias) for ids in prompts]
        await self._admit()
        base_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        gens: list[Generation] = []
        for ids, sampling in zip(prompts, samplings):
            first = None
            for j in range(body.n):
                k = len(gens)
                sp = (sampling if j == 0 or sampling.seed is None
                      else dataclasses.replace(sampling, seed=sampling.seed + j))
                req = RequestMsg(base_id if k == 0 else f"{base_id}-{k}", ids, sp, self.queue.gateway_id,
                                 arrival, share_prompt_with=first)
                first = first or req.req_id
                gens.append(Generation(req, tokenizer=self.tok, queue=self.queue, dispatcher=self.dispatcher,
                                       metrics=self.metrics, stop=body.stop_strings(),
                                       end_token_ids=self._end_ids | set(sp.stop_token_ids),
                                       event_timeout_s=self.cfg.event_timeout_s))
        try:
            for gen in gens:
                await gen.start()
                self.active.add(gen)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not queue %s: %r", base_id, exc)
            await self._close_all(gens)
            raise APIError(503, "could not queue the request", code="queue_unavailable",
                           headers={"Retry-After": str(self.cfg.retry_after_s)}) from exc
        shape = ResponseShape(base_id, self.cfg.model_name, chat, body.include_usage)
        num_prompt = sum(len(ids) for ids in prompts)
        if body.stream:
            return TimedStreamingResponse(self._stream(gens, shape, num_prompt, plan), media_type="text/event-stream",
                                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                          background=BackgroundTask(self._close_all, gens),
                                          send_timeout_s=self.cfg.sse_send_timeout_s,
                                          on_drop=self.metrics.streams_dropped.inc)
        return await self._whole(gens, shape, num_prompt, request, plan)

    def _logprobs(self, shape: ResponseShape, entries: list[TokenLogprob] | None, text_offset: int) -> dict | None:
        if entries is None:
            return None
        fmt = self.logprob_format
        return fmt.chat(entries) if shape.chat else fmt.completion(entries, text_offset)

    async def _stream(self, gens: list[Generation], shape: ResponseShape, num_prompt: int,
                      plan: ToolPlan | None = None):
        """SSE body. On a client disconnect Starlette cancels this generator and then runs the
        response's background task, which closes the generations (that sends the aborts).
        With tools (plan), each choice's text goes through a gateway.tools.ToolStream."""
        offsets = [0] * len(gens)  # characters sent per choice (completions' text_offset)
        tool_streams = [plan.stream() for _ in gens] if plan is not None else None
        try:
            if shape.chat:
                for i in range(len(gens)):
                    yield sse(shape.chunk("", first=True, index=i))
            async for i, d in _merged(gens):
                if d.finish_reason == "error":
                    err = APIError(500, d.error or "generation failed", type="server_error", code="generation_error")
                    yield sse(err.body())
                    yield SSE_DONE
                    return
                if tool_streams is not None:
                    for chunk in self._tool_chunks(tool_streams[i], d, shape, i):
                        yield sse(chunk)
                elif d.text or d.finish_reason or d.logprobs:
                    yield sse(shape.chunk(d.text, d.finish_reason, index=i,
                                          logprobs=self._logprobs(shape, d.logprobs, offsets[i])))
                    offsets[i] += len(d.text)
            if shape.include_usage:
                yield sse(shape.usage_chunk(num_prompt, sum(g.num_tokens for g in gens)))
            yield SSE_DONE
        finally:
            for gen in gens:  # also covers a generator closed without the background task
                self._spawn_close(gen)

    def _tool_chunks(self, ts, d, shape: ResponseShape, index: int) -> list[dict]:
        """The chunks of one delta of a choice that may call tools; logprobs ride on the first."""
        deltas = ts.feed(d.text)
        reason = None
        if d.finish_reason:
            last, reason = ts.finish(d.finish_reason)
            deltas += last
        lps = self._logprobs(shape, d.logprobs, 0) if d.logprobs else None
        chunks = [shape.delta_chunk(delta, index=index, logprobs=lps if k == 0 else None)
                  for k, delta in enumerate(deltas)]
        if reason or (lps and not chunks):
            chunks.append(shape.delta_chunk({}, reason, index=index, logprobs=None if chunks else lps))
        return chunks

    async def _whole(self, gens: list[Generation], shape: ResponseShape, num_prompt: int,
                     request: Request, plan: ToolPlan | None = None) -> Response:
        async def collect(gen: Generation) -> tuple[str, list[TokenLogprob] | None]:
            texts, lps = [], ([] if gen.req.sampling.logprobs is not None else None)
            async for d in gen.deltas():
                texts.append(d.text)
                if lps is not None and d.logprobs:
                    lps.extend(d.logprobs)
            return "".join(texts), lps

        collecting = asyncio.ensure_future(asyncio.gather(*(collect(g) for g in gens)))
        disconnect = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collecting, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():  # the client left: nobody will read the answer
                collecting.cancel()
                collecting.add_done_callback(lambda f: f.cancelled() or f.exception())  # no "never retrieved"
                return Response(status_code=499)
            results = collecting.result()
        finally:
            disconnect.cancel()
            await self._close_all(gens)
        failed = next((g for g in gens if g.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(500, failed.error or "generation failed", type="server_error", code="generation_error")
        choices = []
        for i, (g, (text, lps)) in enumerate(zip(gens, results)):
            if plan is None:
                choices.append(shape.choice(i, text, g.finish_reason, self._logprobs(shape, lps, 0)))
            else:
                content, calls, reason = plan.answer(text, g.finish_reason)
                choices.append(shape.choice(i, content, reason, self._logprobs(shape, lps, 0),
                                            [c.to_dict() for c in calls]))
        return JSONResponse(shape.full(choices, num_prompt, sum(g.num_tokens for g in gens)))

    async def _close(self, gen: Generation) -> None:
        try:
            await gen.close()
        finally:
            self.active.discard(gen)

    async def _close_all(self, gens: list[Generation]) -> None:
        await asyncio.gather(*(self._close(g) for g in gens))

    def _spawn_close(self, gen: Generation) -> None:
        task = asyncio.ensure_future(self._close(gen))
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    async def resubmit_unfinished(self, attempts: int = 10, backoff_s: float = 0.2) -> int:
        """The queue lost its contents (Redis restarted without them): submit every started,
        unfinished request again under its id. The scheduler skips a request it already runs;
        the gateway drops events it has already seen (by index). A request that cannot be
        resubmitted (Redis went away again) ends with an explicit error. Returns how many were
        sent."""
        sent = 0
        for gen in list(self.active):
            if gen.finish_reason is not None or gen.closed:
                continue
            for attempt in range(attempts):
                try:
                    await self.queue.submit(gen.req)
                    sent += 1
                    break
                except Exception as exc:  # noqa: BLE001 - e.g. a pooled connection Redis closed
                    if attempt == attempts - 1:
                        log.error("could not resubmit %s after a queue reset: %s", gen.req.req_id, exc)
                        gen.fail("the request was lost in a queue restart and could not be resubmitted")
                    else:
                        await asyncio.sleep(backoff_s * (attempt + 1))
        log.info("resubmitted %d unfinished requests", sent)
        return sent


def _longest_token(tokenizer) -> int:
    """An upper bound on the characters one token stands for: the longest vocabulary entry (its
    byte-level or piece spelling is at least as long as its text). Unknown: no bound."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return 1 << 30
    return max(map(len, backend.get_vocab(with_added_tokens=True)), default=1)


async def _merged(gens: list[Generation]):
    """(choice index, delta) from all generations, as they come."""
    if len(gens) == 1:
        async for d in gens[0].deltas():
            yield 0, d
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for d in gen.deltas():
                await q.put((i, d))
        finally:
            await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, d = await q.get()
            if d is None:
                left -= 1
            else:
                yield i, d
    finally:
        for t in tasks:
            t.cancel()


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body was already read, so the next ASGI
    message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
