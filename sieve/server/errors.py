"""OpenAI's error object, shared by the server and the gateway: one exception (`APIError`), one response shape, the
handlers that put every failure (a bad field, a wrong route, a bug) in that shape, and the body-size limit. Anthropic's
routes (/v1/messages) answer the same failures in Anthropic's error shape."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("sieve")


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None, path: str = "") -> JSONResponse:
    """The error in OpenAI's shape, or in Anthropic's on its routes (`path`)."""
    body = anthropic_body(status, message, type_) if path.startswith(ANTHROPIC_PATHS) else error_body(message, type_, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


ANTHROPIC_PATHS = ("/v1/messages",)
# OpenAI's error types, and the statuses with a type of their own, as Anthropic names them
ANTHROPIC_TYPES = {"invalid_request_error": "invalid_request_error", "authentication_error": "authentication_error",
                   "rate_limit_exceeded": "rate_limit_error", "server_error": "api_error"}
ANTHROPIC_STATUS_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                          413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_body(status: int, message: str, openai_type: str = "invalid_request_error") -> dict:
    """Anthropic's error object."""
    kind = ANTHROPIC_STATUS_TYPES.get(status, ANTHROPIC_TYPES.get(openai_type, "api_error"))
    return {"type": "error", "error": {"type": kind, "message": message}}


class APIError(Exception):
    """A request answered with an error: `status` and OpenAI's fields, or `body`, an upstream server's own error
    object passed through unchanged."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None, body: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers, self.body = headers, body

    def response(self, path: str = "") -> JSONResponse:
        if self.body is not None:
            return JSONResponse(self.body, status_code=self.status, headers=self.headers)
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers, path)


def install_error_handlers(app: FastAPI, what: str = "serving a request") -> None:
    """Every error `app` raises answers in OpenAI's shape: APIError as it says, a body that fails validation as a 400
    naming the field (an unknown field is `unsupported_field`: never dropped silently), Starlette's 404/405 (a 405 keeps
    its Allow header), and a bug as a 500."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return validation_response(e.errors(), request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unhandled error while %s", what)
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error", path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error",
                              headers=getattr(e, "headers", None), path=request.url.path)


def validation_response(errors: list, path: str = "") -> JSONResponse:
    """A body that fails validation: a 400 naming the field (an unknown field is `unsupported_field`)."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", []) if x != "body"]
    if first.get("type") == "extra_forbidden":
        return error_response(400, f"unknown field `{'.'.join(loc)}`: this server does not implement it", "invalid_request_error",
                              ".".join(loc) or None, code="unsupported_field", path=path)
    return error_response(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}", "invalid_request_error",
                          ".".join(loc) or None, path=path)


class BodyLimit:
    """Pure ASGI middleware (it leaves `receive` to the app once the body is in, so disconnects still reach
    the handlers): a body over `max_bytes` is a 413 in OpenAI's shape, by its Content-Length or, for a
    chunked body, by counting it as it arrives, before the app reads any of it."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                return await self._too_large(scope, receive, send)
            return await self.app(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0  # no Content-Length: read the body here, up to the limit
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        await error_response(413, f"the request body is over the {self.max_bytes}-byte limit (--max-request-body-bytes)",
                             "invalid_request_error", code="request_too_large", path=scope.get("path", ""))(scope, receive, send)
