"""Anthropic's Messages API: /v1/messages (streamed or not) and /v1/messages/count_tokens, translated into the chat
request the server already runs (sieve/server/anthropic.py) and answered in Anthropic's shapes
(sieve/server/messages.py). Its clients send the key as `x-api-key`; errors take Anthropic's shape here."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from sieve.server.anthropic import CountTokensRequest, MessagesRequest
from sieve.server.errors import APIError
from sieve.server.messages import MessageFormat
from sieve.server.routes import collect, first_outputs, prepare_chat, require_api_key, serve, state, submit
from sieve.server.state import ServerState
from sieve.server.tools import check_tools

messages_api = APIRouter(dependencies=[Depends(require_api_key)])
MESSAGES_PATHS = {"/v1/messages", "/v1/messages/count_tokens"}


def chat_request(body: MessagesRequest):
    """The chat request a message request stands for; a translation the chat request refuses is a 400 naming why."""
    try:
        return body.chat_request()
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise APIError(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}") from None


@messages_api.post("/v1/messages")
async def messages(body: MessagesRequest, raw: Request):
    st = state(raw)
    st.check_model(body.model)
    chat = chat_request(body)
    prompt, params = await prepare_chat(st, raw, chat)
    answer = functools.partial(respond, stop_sequences=body.stop_sequences)
    return await serve(st, raw, chat, [prompt], params, "msg_", answer)


async def respond(st: ServerState, raw: Request, chat, prompts: list, params, rid: str, created: int, ids: list,
                  stop_sequences: list[str] | None):
    gens = await submit(st, raw, ids, prompts, params, 0)
    fmt = MessageFormat(rid, st.model_name, chat, stop_sequences, st.reports_cached(raw))
    firsts = await first_outputs(st, gens)
    if chat.stream:
        return StreamingResponse(fmt.events(raw, gens[0], firsts[0]), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    finals = await collect(st, raw, gens, list(zip(gens, firsts)))
    if finals is None:
        return Response(status_code=499)
    return JSONResponse(fmt.full(finals[0]))


@messages_api.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, raw: Request):
    """The prompt's tokens as a message request with these messages, system prompt and tools would have them."""
    st = state(raw)
    st.check_model(body.model)
    st.check_tokenizer()
    messages = [m.template_dict() for m in body.chat_messages()]
    st.check_bytes([m["content"] or "" for m in messages], "messages")
    tools = body.chat_tools()
    if tools:
        try:
            check_tools(tools["tools"], tools.get("tool_choice"))
        except ValueError as e:
            raise APIError(400, str(e), param="tools") from None
    prompt = await st.off_loop(st.render_chat, messages, True, tools.get("tools"))
    return {"input_tokens": len(prompt["prompt_token_ids"])}
