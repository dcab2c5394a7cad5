"""The server's OpenAPI document, told the truth: every status a route can answer, each with its body's
shape (OpenAI's error object for all of them; FastAPI's default 422 never happens here, since a body that
fails validation is a 400), and both content types of a streamable 200."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from sieve.server.errors import ANTHROPIC_PATHS


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for every status that is not a success."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error shape, on its routes (/v1/messages)."""

    type: str
    error: AnthropicErrorDetail


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class CompletionResponse(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any]


class EmbeddingList(_Open):
    object: str
    data: list[dict[str, Any]]
    model: str
    usage: dict[str, Any]


class Message(_Open):
    id: str
    type: str
    role: str
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    usage: dict[str, Any]


class ResponseObject(_Open):
    id: str
    object: str
    status: str
    output: list[dict[str, Any]]


class ResponseDeleted(_Open):
    id: str
    object: str
    deleted: bool


class TokenCount(_Open):
    input_tokens: int


class ModelList(_Open):
    object: str
    data: list[dict[str, Any]]


class TokenizeResponse(_Open):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(_Open):
    prompt: str


class HealthResponse(_Open):
    status: str


WHY = {
    400: "invalid request: a bad or unsupported field, a prompt too long, a value out of range",
    401: "missing or wrong API key",
    404: "unknown model; or (the Batch API) no such file or batch, or no --batch-dir; or (the Responses API) no such "
         "stored response",
    405: "method not allowed",
    413: "request body over --max-request-body-bytes",
    429: "too many requests waiting (--max-waiting), or (--slo-reject) the time-to-first-token objective could no longer "
         "be met; retry after the Retry-After header",
    500: "the engine failed this request (an internal error in a step)",
    503: "the engine has stopped, or it is stalled",
}


def _error(status: int, path: str) -> dict:
    shape = "AnthropicErrorResponse" if path.startswith(ANTHROPIC_PATHS) else "ErrorResponse"
    return {"description": WHY[status], "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}}}


def document(app: FastAPI, protected: set[str]) -> None:
    """Replace `app.openapi` with a generator that lists the statuses each route really answers.
    `protected`: the paths that need the API key (401) when the server has one."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (ErrorResponse, ErrorDetail, AnthropicErrorResponse, AnthropicErrorDetail, Message, TokenCount,
                      ResponseObject, ResponseDeleted,
                      CompletionResponse, EmbeddingList, ModelList, TokenizeResponse, DetokenizeResponse, HealthResponse):
            components[model.__name__] = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        for path, ops in schema["paths"].items():
            for method, op in ops.items():
                responses = op["responses"]
                responses.pop("422", None)
                ok = _success(path, method)
                if ok is not None:
                    responses["200"] = ok
                statuses = {405}
                if method == "post":
                    statuses |= {400, 413}
                if path in protected:
                    statuses.add(401)
                if path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/messages", "/v1/responses"):
                    statuses |= {404, 429, 500, 503}
                if path in ("/tokenize", "/detokenize", "/v1/messages/count_tokens", "/v1/unload_lora_adapter") or path.startswith(("/v1/files", "/v1/batches",
                                                                                                       "/v1/responses/")):
                    statuses.add(404)
                if path.startswith(("/v1/files", "/v1/batches", "/v1/responses/")):
                    statuses.add(400)  # (a bad `limit`; a query parameter, or a cancel of a response not in the background)
                if path == "/health":
                    responses["503"] = {"description": WHY[503], "content": {"application/json": {"schema": {
                        "$ref": "#/components/schemas/HealthResponse"}}}}
                for status in sorted(statuses):
                    responses.setdefault(str(status), _error(status, path))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _success(path: str, method: str) -> dict | None:
    def body(name: str, stream: bool = False) -> dict:
        content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}
        if stream:
            # one server-sent event: `data` holds a JSON chunk (or [DONE])
            content["text/event-stream"] = {"schema": {"type": "object", "properties": {"data": {"type": "string"}},
                                                       "required": ["data"]}}
        return {"description": "success", "content": content}

    return {
        "/v1/completions": body("CompletionResponse", stream=True),
        "/v1/chat/completions": body("CompletionResponse", stream=True),
        "/v1/embeddings": body("EmbeddingList"),
        "/v1/messages": body("Message", stream=True),
        "/v1/messages/count_tokens": body("TokenCount"),
        "/v1/responses": body("ResponseObject", stream=True),
        "/v1/responses/{response_id}": body("ResponseDeleted" if method == "delete" else "ResponseObject"),
        "/v1/responses/{response_id}/cancel": body("ResponseObject"),
        "/v1/load_lora_adapter": {"description": "success", "content": {"text/plain": {"schema": {"type": "string"}}}},
        "/v1/unload_lora_adapter": {"description": "success", "content": {"text/plain": {"schema": {"type": "string"}}}},
        "/v1/models": body("ModelList"),
        "/tokenize": body("TokenizeResponse"),
        "/detokenize": body("DetokenizeResponse"),
        "/health": body("HealthResponse"),
        "/metrics": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
    }.get(path)
