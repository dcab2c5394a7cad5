"""The server's routes, over the ServerState in `app.state.sieve`: the OpenAI API (/v1/models, /v1/completions,
/v1/chat/completions), vLLM's /tokenize and /detokenize, the KV release a gateway calls, and /health, /version,
/metrics, the playground."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import html
import time
import uuid
import weakref
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

import sieve
from sieve.engine import RequestError
from sieve.server.async_engine import EngineError
from sieve.server.errors import APIError
from sieve.pooling import PoolingParams
from sieve.sampling_params import SamplingParams
from sieve.server.embeddings import EmbeddingRequest, embedding_response
from sieve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from sieve.server.responses import ResponseFormat
from sieve.server.state import ServerState
from sieve.server.streaming import EventStream, error_event, queue_headers, queue_ms

# the routes that need a key when the server has keys (/metrics too, unless --metrics-public)
KEYED = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize", "/v1/kv_transfer/release"}


def state(request: Request) -> ServerState:
    return request.app.state.sieve


async def require_api_key(request: Request) -> None:
    """A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware wraps `receive`, which would hide client
    disconnects from the handlers (and disconnects must abort requests)."""
    state(request).tenant_of(request)


async def require_metrics_key(request: Request) -> None:
    st = state(request)
    if not st.options.metrics_public:
        st.tenant_of(request)


public = APIRouter()
api = APIRouter(dependencies=[Depends(require_api_key)])
playground_page = APIRouter()


@public.get("/health")
async def health(request: Request):
    st = state(request)
    aengine = st.aengine
    if aengine.error is not None:
        return JSONResponse({"status": "dead", "error": f"{type(aengine.error).__name__}: {aengine.error}"}, status_code=503)
    stalled = time.monotonic() - aengine.last_progress
    if stalled > st.options.health_stall_seconds and (st.engine.has_unfinished() or aengine.num_pending):
        return JSONResponse({"status": "stalled", "seconds_since_last_step": round(stalled, 1)}, status_code=503)
    return {"status": "ok"}


@public.get("/metrics", dependencies=[Depends(require_metrics_key)])
async def metrics_endpoint(request: Request):
    return Response(state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@public.get("/version")
async def version(request: Request):
    """The version, and the service-level objective the server's run-time choices serve (null: none)."""
    config = state(request).engine.config
    return {"version": sieve.__version__,
            "slo": {"ttft_ms": config.slo_ttft_ms, "tpot_ms": config.slo_tpot_ms, "reject": config.slo_reject}}


@functools.cache
def playground_html() -> str:
    return (Path(__file__).parent / "webui.html").read_text()


@playground_page.get("/", include_in_schema=False)
async def playground(request: Request):
    """The chat playground: one self-contained page (no build step, no external assets)."""
    st = state(request)
    page = playground_html()
    return HTMLResponse(page.replace("__MODEL__", html.escape(st.model_name)).replace("__NEEDS_KEY__", "true" if st.keys.enabled else "false"))


@api.get("/v1/models")
async def models(request: Request):
    st = state(request)
    base = {"object": "model", "created": 0, "owned_by": "sieve", "max_model_len": st.engine.config.max_model_len}
    return {"object": "list", "data": [{"id": st.model_name, **base},
                                       *({"id": name, **base, "parent": st.model_name} for name in st.adapter_names())]}


@api.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request):
    st = state(raw)
    st.check_model(body.model)
    # echo with logprobs scores the prompt too (how evaluation harnesses get a loglikelihood)
    prompt_lp = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_lp = max(prompt_lp or 0, body.logprobs)
    params = st.sampling_params(body, body.max_tokens, body.logprobs, prompt_lp)
    st.tenant_salt(raw, params)
    await st.compile_grammar(params)
    prompts = body.prompts()
    if len(prompts) > st.options.max_prompts:
        raise APIError(400, f"{len(prompts)} prompts are over this server's limit of {st.options.max_prompts} per request "
                            "(--max-prompts-per-request)", param="prompt")
    prompts = await encode_prompts(st, prompts)
    return await serve(st, raw, body, prompts, params, "cmpl-", functools.partial(respond, chat=False))


async def encode_prompts(st: ServerState, prompts: list, param: str = "prompt") -> list:
    """Text prompts tokenized on the tokenizer pool, all at once; token ids checked here (they need no tokenizer)."""
    st.check_bytes(prompts, param)
    texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
    prompts = [p if isinstance(p, str) else st.encode_prompt(p) for p in prompts]
    for i, encoded in zip(texts, await asyncio.gather(*(st.off_loop(st.encode_prompt, prompts[i]) for i in texts))):
        prompts[i] = encoded
    return prompts


@api.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, raw: Request):
    """OpenAI's embeddings: each input's final hidden states, pooled (--embedding-pooling), prefilled in the steps that
    serve everything else."""
    st = state(raw)
    st.check_model(body.model)
    size = st.engine.arch.hidden_size
    if body.dimensions not in (None, size):
        raise APIError(400, f"this model's embeddings have {size} dimensions and it was not trained to shorten them: "
                            f"`dimensions` can only be {size}", param="dimensions", code="unsupported_field")
    prompts = body.prompts()
    if len(prompts) > st.options.max_prompts:
        raise APIError(400, f"{len(prompts)} inputs are over this server's limit of {st.options.max_prompts} per request "
                            "(--max-prompts-per-request)", param="input")
    prompts = await encode_prompts(st, prompts, "input")
    params = SamplingParams(max_tokens=0, pooling=PoolingParams(st.options.embedding_pooling),
                            lora_request=st.lora_request(body.model))
    st.tenant_salt(raw, params)
    return await serve(st, raw, body, prompts, params, "embd-", embed)


async def embed(st: ServerState, raw: Request, body: EmbeddingRequest, prompts: list, params, rid: str, created: int,
                ids: list):
    gens = await submit(st, raw, ids, prompts, params, 0)
    finals = await collect(st, raw, gens, list(zip(gens, await first_outputs(st, gens))))
    if finals is None:
        return Response(status_code=499)
    return JSONResponse(embedding_response(finals, st.model_name, body.encoding_format))


@api.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, raw: Request):
    st = state(raw)
    st.check_model(body.model)
    prompt, params = await prepare_chat(st, raw, body)
    return await serve(st, raw, body, [prompt], params, "chatcmpl-", functools.partial(respond, chat=True))


async def prepare_chat(st: ServerState, raw: Request, body: ChatCompletionRequest) -> tuple[dict, SamplingParams]:
    """A chat request's prompt (through the chat template, with its tools) and sampling parameters (its grammar
    compiled), once every field has passed this server's checks."""
    if st.tokenizer is None:
        raise APIError(400, "this server has no tokenizer, so no chat template")
    n_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    st.check_bytes([m.text() for m in body.messages], "messages")
    params = st.sampling_params(body, body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
                                n_logprobs, body.prompt_logprobs)
    st.tenant_salt(raw, params)
    await st.compile_grammar(params, "tool_choice" if body.tool_mode and body.tool_choice not in (None, "auto") else None)
    prompt = await st.off_loop(st.render_chat, [m.template_dict() for m in body.messages], body.add_generation_prompt,
                               body.tools if body.tool_mode else None)
    return prompt, params


@api.post("/v1/kv_transfer/release")
async def kv_release(body: dict, request: Request):
    """A gateway gives back the blocks of a prefill this server exported (its own signed kv_transfer_params) when
    no decode server will take them, instead of leaving them held for the whole lease."""
    from sieve.distributed.kv_transfer import KVParamsError

    conn = getattr(state(request).engine, "kv_connector", None)
    if conn is None or conn.store is None:
        raise APIError(400, "this server exports no KV (start it with --role prefill or both)", param="kv_transfer_params")
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise APIError(400, "kv_transfer_params must be an object", param="kv_transfer_params")
    try:
        return {"released_blocks": conn.release(params)}
    except KVParamsError as e:
        raise APIError(400, f"kv_transfer_params: {e}", param="kv_transfer_params") from None


@api.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    """vLLM's /tokenize: a prompt, or chat messages through the template, to token ids."""
    st = state(request)
    st.check_model(body.model)
    st.check_tokenizer()
    tokenizer = st.tokenizer
    if body.messages is not None:
        st.check_bytes([m.text() for m in body.messages], "messages")
        prompt = await st.off_loop(st.render_chat, [m.template_dict() for m in body.messages], body.add_generation_prompt)
        ids = prompt["prompt_token_ids"]
    else:
        st.check_bytes([body.prompt])
        ids = await st.off_loop(lambda: tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        st.check_length(ids)
    return {"count": len(ids), "max_model_len": st.engine.config.max_model_len, "tokens": ids,
            "token_strs": [tokenizer.convert_ids_to_tokens(t) for t in ids] if body.return_token_strs else None}


@api.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    """vLLM's /detokenize: token ids to text."""
    st = state(request)
    st.check_model(body.model)
    st.check_tokenizer()
    vocab = st.engine.arch.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is out of range for vocabulary size {vocab}", param="tokens")
    return {"prompt": await st.off_loop(st.tokenizer.decode, body.tokens)}


async def serve(st: ServerState, raw: Request, body, prompts: list, params, kind: str, answer):
    """Admit every prompt of the request at once (they share the next step; the engine gives each its own copy of
    the sampling parameters), then stream or collect their outputs: `answer(st, raw, body, prompts, params, rid,
    created, ids)` gives the response, its id `kind` and a random hex. A client that goes away aborts them."""
    st.check_capacity(raw)
    rid = f"{kind}{uuid.uuid4().hex}"
    created = int(time.time())
    ids = [f"{rid}-{i}" for i in range(len(prompts))]
    leased = st.admit_tenant(raw, ids, sum(len(p.get("prompt_token_ids", ())) for p in prompts if isinstance(p, dict)))
    streaming = False
    try:
        response = await answer(st, raw, body, prompts, params, rid, created, ids)
        held_by = getattr(raw.state, "held_by", None)  # a task that runs on (a background response)
        streaming = leased and (isinstance(response, StreamingResponse) or held_by is not None)
        if streaming and held_by is not None:
            held_by.add_done_callback(lambda _: st.release_tenant(raw))
        elif streaming:  # the tenant's request is in flight until its stream ends
            response.body_iterator = released(response.body_iterator, Once(lambda: st.release_tenant(raw)))
        return response
    finally:
        if leased and not streaming:
            st.release_tenant(raw)


class Once:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


def released(events, release: Once):
    """`events`, then `release()` however they end: a client that goes away closes them, and a stream never started
    (its client gone before the first byte) is released when it is collected."""
    async def gen():
        try:
            async for event in events:
                yield event
        finally:
            release()

    g = gen()
    weakref.finalize(g, release)
    return g


async def submit(st: ServerState, raw: Request, ids: list, prompts: list, params, client_priority: int) -> list:
    """The request's prompts into the engine together; their output generators."""
    priority = st.priority(raw, client_priority)
    await st.ready_adapter(params)
    try:
        return await st.aengine.submit([(i, prompt, params, priority, st.tenancy(raw)) for i, prompt in zip(ids, prompts)])
    except (RequestError, EngineError) as e:
        raise st.as_api_error(e) from e


async def respond(st: ServerState, raw: Request, body, prompts: list, params, rid: str, created: int, ids: list, chat: bool):
    """Stream or collect the outputs of the request's prompts, submitted together."""
    gens = await submit(st, raw, ids, prompts, params, body.priority)
    fmt = ResponseFormat(st.tokenizer, st.model_name, st.reports_cached(raw))
    n_top = params.logprobs or 0
    queue = queue_headers([g.queue_estimate for g in gens])
    if body.stream and body.stream_options and body.stream_options.include_queue:  # the wait told before it ends
        return StreamingResponse(queued_events(st, raw, gens, queue, lambda streams: EventStream(
            fmt, rid, created, streams, params.n, chat, body, n_top).events(raw)), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **queue})
    # the first output of each (a failed step before it is still an HTTP error, not a broken stream)
    streams = list(zip(gens, await first_outputs(st, gens)))
    if body.stream:
        events = EventStream(fmt, rid, created, streams, params.n, chat, body, n_top).events(raw)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    finals = await collect(st, raw, gens, streams)
    if finals is None:
        return Response(status_code=499)
    waited = queue_ms(finals)
    return JSONResponse(fmt.full_response(rid, created, finals, params.n, chat, body, n_top),
                        headers={**queue, **({"x-sieve-queue-ms": str(waited)} if waited is not None else {})})


QUEUE_UPDATE_S = 1.0  # stream_options.include_queue: how often a waiting stream is told its expected wait again


async def queued_events(st: ServerState, raw: Request, gens: list, queue: dict, events_of):
    """stream_options.include_queue: an SSE comment with the expected wait at once (OpenAI's clients skip comments),
    the same again every QUEUE_UPDATE_S while it waits, then the stream as usual once each prompt's first output is
    in; a failure before it is an error event."""
    yield queue_comment(queue)
    firsts = asyncio.ensure_future(first_outputs(st, gens))
    try:
        while not (await asyncio.wait({firsts}, timeout=QUEUE_UPDATE_S))[0]:
            asking = asyncio.ensure_future(asyncio.gather(*(st.aengine.queue_estimate(g.request_id) for g in gens)))
            await asyncio.wait({firsts, asking}, return_when=asyncio.FIRST_COMPLETED)  # (a dead engine answers none)
            if firsts.done():
                asking.cancel()
            elif update := queue_headers(asking.result()):
                yield queue_comment(update)
        firsts = firsts.result()
    except APIError as e:
        yield error_event(e.message, e.code, e.type)
        yield "data: [DONE]\n\n"
        return
    finally:
        if isinstance(firsts, asyncio.Future):
            firsts.cancel()
    async for event in events_of(list(zip(gens, firsts))):
        yield event


def queue_comment(headers: dict) -> str:
    return ": queue " + " ".join(f"{k.removeprefix('x-sieve-')}={v}" for k, v in headers.items()) + "\n\n"


async def first_outputs(st: ServerState, gens: list) -> list:
    """Each prompt's first output; an engine failure before it, or --slo-reject's refusal (its first token could no
    longer come within the objective), closes them all and is an APIError."""
    try:
        firsts = await asyncio.gather(*(g.__anext__() for g in gens))
    except BaseException as e:
        for g in gens:
            await g.aclose()
        if isinstance(e, EngineError):
            raise st.as_api_error(e) from e
        raise
    refused = next((f for f in firsts if f.retry_after_s is not None), None)
    if refused is not None:
        for g in gens:
            await g.aclose()
        raise st.slo_unmet(refused.retry_after_s)
    return firsts


async def collect(st: ServerState, raw: Request, gens: list, streams: list) -> list | None:
    """Every prompt's last output; None when the client went away first (its requests are aborted at once)."""
    async def last_of(gen, first):
        last = first
        async for out in gen:
            last = out
        return last

    task = asyncio.ensure_future(asyncio.gather(*(last_of(g, f) for g, f in streams)))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
        return task.result()
    except EngineError as e:  # the engine failed this request after admitting it
        raise st.as_api_error(e) from e
    finally:
        for g in gens:  # aborts whatever has not finished (a no-op for the rest)
            await g.aclose()
