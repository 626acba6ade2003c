"""The one mapping from errors to OpenAI-shaped HTTP errors.

Every error response has the body {"error": {"message", "type", "param", "code"}}:
* invalid parameters, invalid JSON, over-long prompts -> 400 invalid_request_error
  (FastAPI's own 422 for a body that does not validate is turned into this 400 too);
* missing or wrong API key -> 401 authentication_error, code invalid_api_key;
* an unknown model -> 404 (code model_not_found); a body over the size limit -> 413;
* queue full -> 429 rate_limit_exceeded with Retry-After; queue unreachable or the server
  draining -> 503;
* a failed generation -> 500 server_error.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.sampling import InvalidRequestError

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                   429: "rate_limit_exceeded", 503: "service_unavailable"}


class APIError(Exception):
    """An error to answer with. status: HTTP status; the rest is the OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_invalid_request(exc: InvalidRequestError) -> APIError:
    return APIError(400, exc.message, param=exc.param, code=exc.code)


def from_validation(exc: RequestValidationError) -> APIError:
    """The first pydantic error, with the offending field as `param` (dotted path)."""
    err = (exc.errors() or [{}])[0]
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if not loc:
        return APIError(400, "the request body must be a JSON object (Content-Type: application/json)",
                        code="invalid_json")
    param = ".".join(loc)
    return APIError(400, f"{param}: {err.get('msg', 'invalid value')}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Register the handlers. on_error(api_error) is called for each error answered (metrics)."""

    def answer(err: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(err)
        return err.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return answer(exc)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError):
        return answer(from_invalid_request(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return answer(from_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return answer(APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return answer(APIError(500, "internal server error", type="server_error"))


class BodySizeLimit:
    """ASGI middleware: a request body above max_bytes is answered 413 in the OpenAI shape,
    before anything parses it. A declared Content-Length is checked first; a chunked body is
    counted as it is read (and buffered, at most max_bytes, for the app)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                return await self._answer(APIError(400, "invalid Content-Length header"), scope, receive, send)
            if too_big:
                return await self._answer(self._error(), scope, receive, send)
            return await self.app(scope, receive, send)
        if headers.get(b"transfer-encoding", b"").lower() != b"chunked":
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            if size > self.max_bytes:
                return await self._answer(self._error(), scope, receive, send)
            if not msg.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    def _error(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes", code="request_too_large")

    @staticmethod
    async def _answer(err: APIError, scope, receive, send) -> None:
        await err.response()(scope, receive, send)
