"""OpenAI's Files and Batch API (`--batch-dir`): upload a JSONL file of requests, create a batch over it, follow it,
cancel it, read its output and error files. Each tenant sees its own files and batches only."""

from __future__ import annotations

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from sieve.server.batch_store import BatchError, BatchStore
from sieve.server.errors import APIError
from sieve.server.routes import require_api_key, state

batch_api = APIRouter(dependencies=[Depends(require_api_key)])
BATCH_PATHS = {"/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches", "/v1/batches/{batch_id}",
               "/v1/batches/{batch_id}/cancel"}


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict | None = None


def store_of(request: Request) -> BatchStore:
    store = state(request).batches
    if store is None:
        raise APIError(404, "this server runs without the Batch API (start it with --batch-dir DIR)", code="not_found")
    return store


@batch_api.post("/v1/files")
async def create_file(request: Request, file: UploadFile = File(...), purpose: str = Form(...)):
    store = store_of(request)
    if purpose != "batch":
        raise APIError(400, f"purpose must be 'batch' (the only files this server takes), got {purpose!r}", param="purpose")
    content = await file.read()
    return store.add_file(request.state.tenant, purpose, file.filename or "upload.jsonl", content)


def found(value, kind: str, name: str):
    """`value`, or a 404 naming the file or batch the tenant has no such one of."""
    if value is None:
        raise APIError(404, f"no {kind} {name!r}", param=f"{kind}_id", code="not_found")
    return value


@batch_api.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request):
    return found(store_of(request).file(request.state.tenant, file_id), "file", file_id)


@batch_api.get("/v1/files/{file_id}/content")
async def get_file_content(file_id: str, request: Request):
    content = found(store_of(request).file_content(request.state.tenant, file_id), "file", file_id)
    return Response(content, media_type="application/jsonl")


@batch_api.post("/v1/batches")
async def create_batch(body: CreateBatch, request: Request):
    try:
        return store_of(request).create_batch(request.state.tenant, body.input_file_id, body.endpoint,
                                              body.completion_window, body.metadata)
    except BatchError as e:
        raise APIError(404 if e.param == "input_file_id" else 400, str(e), param=e.param) from None


@batch_api.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request):
    return found(store_of(request).batch(request.state.tenant, batch_id), "batch", batch_id)


@batch_api.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request):
    return found(store_of(request).cancel(request.state.tenant, batch_id), "batch", batch_id)


@batch_api.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20):
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be between 1 and 100", param="limit")
    data, more = store_of(request).list_batches(request.state.tenant, after, limit)
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
