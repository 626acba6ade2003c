"""The OpenAI-compatible gateway: a FastAPI app over a tokenizer and a GatewayQueue.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET
/v1/models/{model}; GET /health (the process is alive), GET /ready (model loaded, event stream
running, a scheduler reachable, not draining), GET /metrics (Prometheus). Torch-free.

With an API key, /v1/* and /metrics need `Authorization: Bearer <key>` (else 401); /health,
/ready and /openapi.json stay open (probes carry no key; they say nothing about requests).
gateway.server refuses to serve without a key on a non-loopback address. Answers never carry
exception text: the exception is logged, the client gets a fixed message.

Request bodies above max_body_bytes get 413 (before any parsing). While draining (SIGTERM, see
gateway.server) new generation requests get 503 and /ready answers 503; requests already
started run to their end.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from typing import Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute

from gateway import openapi
from gateway.errors import APIError, BodySizeLimit, install_error_handlers
from gateway.generation import Dispatcher
from gateway.metrics import GatewayMetrics
from gateway.preprocess import PreprocessConfig, off_loop_json_route
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.serving import Serving, ServingConfig
from shared.config import ModelInfo
from shared.limits import MAX_BODY_COLONS, MAX_BODY_COMMAS
from shared.queue import GatewayQueue

ReadyCheck = Callable[[], Awaitable[bool]]
log = logging.getLogger(__name__)


def create_app(tokenizer, model_info: ModelInfo, queue: GatewayQueue, *, api_key: str | None = None,
               max_queue_depth: int = 1024, model_name: str | None = None, default_max_tokens: int = 256,
               ready_check: ReadyCheck | None = None, event_timeout_s: float | None = 600.0,
               metrics: GatewayMetrics | None = None, max_body_bytes: int = 4 << 20,
               parse_control_tokens: bool = False, preprocess: PreprocessConfig | None = None,
               sse_send_timeout_s: float | None = 30.0) -> FastAPI:
    """The gateway app. It owns `queue` from here on (closes it at shutdown).

    api_key: if set, /v1/* and /metrics need `Authorization: Bearer <api_key>` (else 401).
    max_queue_depth: requests queued and not yet taken; at or above it: 429 + Retry-After.
    model_name: the name served (default model_info.name); requests naming another model (other
        than model_info.name) get 404 model_not_found.
    max_body_bytes: larger request bodies get 413.
    ready_check: async () -> bool, the "scheduler reachable" half of /ready (default: a fresh
        scheduler heartbeat in the queue, queue.scheduler_alive).
    event_timeout_s: seconds without a token event before a request fails (None: never).
    parse_control_tokens, preprocess, sse_send_timeout_s: see gateway.serving.ServingConfig.
    """
    metrics = metrics or GatewayMetrics()
    dispatcher = Dispatcher(queue)
    cfg = ServingConfig(model_name=model_name or model_info.name, max_queue_depth=max_queue_depth,
                        default_max_tokens=default_max_tokens, event_timeout_s=event_timeout_s,
                        aliases=(model_info.name,), parse_control_tokens=parse_control_tokens,
                        preprocess=preprocess or PreprocessConfig(), sse_send_timeout_s=sse_send_timeout_s)
    serving = Serving(tokenizer, model_info, queue, dispatcher, metrics, cfg)
    dispatcher.on_queue_reset = serving.resubmit_unfinished
    ready_check = ready_check or queue.scheduler_alive
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(dispatcher.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            serving.pre.close()
            await queue.close()

    app = FastAPI(title="sarathi gateway", lifespan=lifespan)
    app.state.serving, app.state.metrics, app.state.queue = serving, metrics, queue
    app.state.has_api_key = bool(api_key)   # gateway.server checks it against the bind address

    def count_rejection(err: APIError) -> None:
        if err.status < 500 or err.status == 503:  # answered before queueing
            metrics.rejected.labels(status=str(err.status)).inc()

    install_error_handlers(app, on_error=count_rejection)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    check_key = _bearer_check(api_key) if api_key else None
    auth = [Depends(check_key)] if check_key else []
    # The generation routes' class checks the key before the body is read, then parses the body
    # off the event loop (gateway.preprocess); the other routes are plain.
    app.router.route_class = off_loop_json_route(serving.pre, MAX_BODY_COMMAS, MAX_BODY_COLONS,
                                                 authorize=check_key)

    @app.post("/v1/completions", responses=openapi.generation(openapi.Completion))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completion(body, request)

    @app.post("/v1/chat/completions", responses=openapi.generation(openapi.ChatCompletion))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    app.router.route_class = APIRoute

    def model_card() -> dict:
        return {"id": cfg.model_name, "object": "model", "created": started, "owned_by": "sarathi",
                "max_model_len": model_info.max_model_len}

    @app.get("/v1/models", dependencies=auth, response_model=openapi.ModelList, responses=openapi.errors(401))
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=auth, response_model=openapi.ModelCard,
             responses=openapi.errors(401, 404))
    async def model(model: str) -> dict:
        serving.check_model(model)
        return model_card()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready", responses={200: {"model": openapi.Readiness, "description": "ready"},
                                  503: {"model": openapi.Readiness, "description": "not ready, with the reason"}})
    async def ready() -> Response:
        reason = None
        if serving.draining:
            reason = "draining: the server is shutting down"
        elif not dispatcher.running:
            reason = "the token event stream is not running"
        else:
            try:
                if not await ready_check():
                    reason = "no scheduler is reachable"
            except Exception as exc:  # noqa: BLE001 - e.g. Redis down: not ready, not a crash
                log.warning("readiness check failed: %r", exc)
                reason = "the readiness check failed (the server's log has the details)"
        if reason:
            return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ready", "model": cfg.model_name})

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=auth,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}, **openapi.errors(401)})
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    default_openapi = app.openapi

    def truthful_openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi.without_422(default_openapi())
        return app.openapi_schema

    app.openapi = truthful_openapi
    return app


def _bearer_check(api_key: str):
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError(401, "invalid or missing API key (expected 'Authorization: Bearer <key>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check
