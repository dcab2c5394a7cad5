"""OpenAI's Responses API: POST /v1/responses (whole, streamed as typed events, or in the background), GET and DELETE
/v1/responses/{id}, POST /v1/responses/{id}/cancel. A turn continues an earlier stored one through
`previous_response_id`; `store: false` keeps nothing. Requests run as the chat request they translate to
(sieve/server/responses_protocol.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from sieve.server.async_engine import EngineError
from sieve.server.errors import APIError
from sieve.server.response_objects import ResponseBuilder
from sieve.server.response_store import Stored
from sieve.server.responses_protocol import ResponsesRequest
from sieve.server.routes import collect, first_outputs, prepare_chat, require_api_key, serve, state, submit
from sieve.server.state import ServerState

responses_api = APIRouter(dependencies=[Depends(require_api_key)])
RESPONSES_PATHS = {"/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel"}


def no_query(request: Request) -> None:
    """No route here reads a query parameter (a background response is not streamed again): one given is a 400."""
    for name in request.query_params:
        raise APIError(400, f"the query parameter `{name}` is not supported by this server", param=name, code="unsupported_field")


@responses_api.post("/v1/responses")
async def create(body: ResponsesRequest, raw: Request):
    st = state(raw)
    no_query(raw)
    st.check_model(body.model)
    history = st.responses.get(raw.state.tenant, body.previous_response_id, "previous_response_id").history \
        if body.previous_response_id is not None else []
    try:
        chat = body.chat_request(history)
    except (ValidationError, ValueError) as e:
        raise APIError(400, str(e).splitlines()[-1] if isinstance(e, ValidationError) else str(e)) from None
    prompt, params = await prepare_chat(st, raw, chat)
    builder = functools.partial(ResponseBuilder, model_name=st.model_name, body=body, chat=chat,
                                history=history + body.messages(), report_cached=st.reports_cached(raw))
    return await serve(st, raw, body, [prompt], params, "resp_", functools.partial(respond, builder=builder))


async def respond(st: ServerState, raw: Request, body: ResponsesRequest, prompts: list, params, rid: str, created: int,
                  ids: list, builder):
    b: ResponseBuilder = builder(rid, created)
    tenant = raw.state.tenant

    def keep(response: dict) -> None:
        if body.store:
            st.responses.put(Stored(tenant, response, b.conversation()))

    gens = await submit(st, raw, ids, prompts, params, 0)
    if body.background:
        entry = Stored(tenant, b.response("queued"))
        entry.task = asyncio.create_task(run_in_background(st, b, gens[0], entry))
        st.responses.put(entry)
        raw.state.held_by = entry.task  # the tenant's request is in flight until it ends
        return JSONResponse(entry.response)
    firsts = await first_outputs(st, gens)
    if body.stream:
        return StreamingResponse(b.events(raw, gens[0], firsts[0], keep), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    finals = await collect(st, raw, gens, list(zip(gens, firsts)))
    if finals is None:
        return Response(status_code=499)
    response = b.full(finals[0])
    keep(response)
    return JSONResponse(response)


async def run_in_background(st: ServerState, b: ResponseBuilder, gen, entry: Stored) -> None:
    """A background response, whoever is connected: its status as it goes, then its output (or why it failed)."""
    last = None
    try:
        async for out in gen:
            if out.retry_after_s is not None:  # --slo-reject: it could not start within the objective
                entry.response = b.response("failed", error={"code": "slo_unmet", "message": "the server could not start "
                                                             "this response within its time-to-first-token objective"})
                return
            if last is None:
                entry.response = b.response("in_progress")
            last = out
        entry.response, entry.history = b.full(last), b.conversation()
    except asyncio.CancelledError:
        entry.response = b.response("cancelled")
    except EngineError as e:
        entry.response = b.response("failed", error={"code": "engine_error", "message": str(e)})
    finally:
        await gen.aclose()


@responses_api.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, raw: Request):
    no_query(raw)
    return state(raw).responses.get(raw.state.tenant, response_id).response


@responses_api.delete("/v1/responses/{response_id}")
async def delete(response_id: str, raw: Request):
    no_query(raw)
    state(raw).responses.delete(raw.state.tenant, response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@responses_api.post("/v1/responses/{response_id}/cancel")
async def cancel(response_id: str, raw: Request):
    """A background response stops where it is (its tokens so far are dropped) and is `cancelled`; one that has
    finished is returned as it is."""
    no_query(raw)
    entry = state(raw).responses.get(raw.state.tenant, response_id)
    if not entry.response.get("background"):
        raise APIError(400, "only background responses can be cancelled", param="response_id")
    task = entry.task
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return entry.response
