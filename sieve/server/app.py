"""OpenAI-compatible HTTP server: /v1/models, /v1/completions, /v1/chat/completions, /health, /version."""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import sieve
from sieve.engine import LLMEngine, RequestError, ServerBusy
from sieve.outputs import RequestOutput
from sieve.server.async_engine import AsyncEngine, EngineError
from sieve.server.auth import APIKeys
from sieve.server.metrics import Metrics
from sieve.server.openapi import document
from sieve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from sieve.server.tools import ToolCallParser, parse_tool_calls, render_messages, tool_names
from sieve.structured import GrammarError


log = logging.getLogger("sieve")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status, headers=headers)


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
                             "invalid_request_error", code="request_too_large")(scope, receive, send)


@dataclass
class ServerLimits:
    """What one request may ask for (each a `sieve serve` flag): stop strings are scanned on every token and held back
    from streams by the longest one, logit_bias is applied every step, an unread stream holds every output, a grammar
    compiles on a shared pool."""

    max_stop_strings: int = 32
    max_stop_string_chars: int = 256
    max_logit_bias: int = 1024
    max_prompt_bytes: int | None = None  # default: the prompt token limit x the vocabulary's longest token
    max_stream_backlog: int = 256
    grammar_workers: int = 2

    def __post_init__(self) -> None:
        for name in ("max_stop_strings", "max_stop_string_chars", "max_logit_bias", "max_stream_backlog", "grammar_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


def longest_token_bytes(tokenizer) -> int:
    """The most bytes one token of this vocabulary stands for (at least 1; 32 without a tokenizer)."""
    if tokenizer is None:
        return 32
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 (a tokenizer without a vocabulary listing)
        return 64
    return max(1, max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1))


def create_app(engine: LLMEngine | Callable[[], LLMEngine], served_model_name: str | None = None, api_key: str | APIKeys | None = None,
               max_waiting: int | None = None, allow_client_priority: bool = False, metrics_public: bool = False,
               health_stall_seconds: float = 60.0, max_n: int = 128, max_prompts: int = 64,
               max_body_bytes: int = 16 << 20, max_prompt_tokens: int | None = None, tokenizer_workers: int = 1,
               grammar_timeout: float = 10.0, webui: bool = True, limits: "ServerLimits | None" = None,
               shared_prefix_cache: bool = False) -> FastAPI:
    """`engine`: an engine, or a function that builds one in the engine's own thread (what `sieve serve`
    does: see sieve/server/async_engine.py for why). A request's `priority` is honoured only with
    `allow_client_priority` (otherwise setting it is a 400: any client could jump the queue); with an
    `api_key`, /metrics needs it too unless `metrics_public`. Limits: `max_n` choices and `max_prompts`
    prompts per request (400 past them), `max_body_bytes` per body (413), `max_prompt_tokens` per prompt (400; default:
    the context length). /health answers 503 when the engine thread has died, or when work is queued and no step has
    finished for `health_stall_seconds`. Tokenization and chat templates run on a pool of `tokenizer_workers`
    threads, never on the event loop or the engine thread (a long prompt stalls neither other clients nor steps);
    one by default, as vLLM's: a fast tokenizer used from two threads at once can fail ("Already borrowed").
    `limits`: what one request may ask for (ServerLimits: stop strings, logit_bias, prompt bytes, stream backlog,
    grammar compiles). `api_key`: one key, or several (APIKeys), each a tenant's: with more than one tenant each
    tenant's requests are salted apart in the prefix cache (a hit never crosses tenants) unless `shared_prefix_cache`,
    and then no response reports cached_tokens (a hit may be another tenant's)."""
    limits = limits or ServerLimits()
    aengine = AsyncEngine(engine, max_backlog=limits.max_stream_backlog)
    engine = aengine.engine
    model_name = served_model_name or engine.model_name
    metrics = Metrics(engine, model_name)
    aengine.on_finished = metrics.record_finished
    aengine.on_slow_reader = lambda rid: metrics.limit_refused("stream_backlog")

    tokenize_pool = ThreadPoolExecutor(max_workers=tokenizer_workers, thread_name_prefix="sieve-tokenize")
    # structured-output grammars compile here, each within its own deadline (time queued behind others does not count)
    grammar_pool = ThreadPoolExecutor(max_workers=limits.grammar_workers, thread_name_prefix="sieve-grammar")

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        aengine.stop()  # (the tokenizer pool lives as long as the app: its idle threads end with the process)

    app = FastAPI(title="sieve", version=sieve.__version__, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    tokenizer = engine.tokenizer
    prompt_token_limit = max_prompt_tokens or engine.config.max_model_len
    # A prompt of more bytes than the limit's tokens could ever hold is refused before it is tokenized
    prompt_byte_limit = limits.max_prompt_bytes or prompt_token_limit * longest_token_bytes(tokenizer)
    app.state.async_engine = aengine

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        if first.get("type") == "extra_forbidden":  # a field this server does not know: never dropped silently
            return error_response(400, f"unknown field `{'.'.join(loc)}`: this server does not implement it", "invalid_request_error",
                                  ".".join(loc) or None, code="unsupported_field")
        return error_response(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}", "invalid_request_error", ".".join(loc) or None)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):  # a bug must still answer in the OpenAI shape
        log.exception("unhandled error while serving a request")
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error",
                              headers=getattr(e, "headers", None))  # a 405 keeps its Allow header

    # A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware wraps `receive`, which would
    # hide client disconnects from the handlers (and disconnects must abort requests).
    keys = api_key if isinstance(api_key, APIKeys) else APIKeys({api_key: "default"} if api_key else {})
    salted = keys.num_tenants > 1 and not shared_prefix_cache  # each tenant's prefix cache apart
    report_cached = keys.num_tenants <= 1 or salted  # a shared cache's hit may be another tenant's: not reported

    async def require_api_key(request: Request) -> None:  # constant-time comparison: no timing oracle on the key
        request.state.tenant = keys.tenant(request.headers.get("authorization")) if keys.enabled else ""
        if request.state.tenant is None:
            raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")

    def tenant_salt(request: Request, params) -> None:
        """With several tenants, a request's blocks are named under its tenant (and its own cache_salt, if any)."""
        if salted:
            params.cache_salt = f"tenant:{request.state.tenant}" + (f"|{params.cache_salt}" if params.cache_salt else "")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{model_name}`", code="model_not_found", param="model")

    @app.get("/health")
    async def health():
        if aengine.error is not None:
            return JSONResponse({"status": "dead", "error": f"{type(aengine.error).__name__}: {aengine.error}"}, status_code=503)
        stalled = time.monotonic() - aengine.last_progress
        if stalled > health_stall_seconds and (engine.has_unfinished() or aengine.num_pending):
            return JSONResponse({"status": "stalled", "seconds_since_last_step": round(stalled, 1)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", dependencies=[] if metrics_public else [Depends(require_api_key)])
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if webui:
        page = (Path(__file__).parent / "webui.html").read_text()

        @app.get("/", include_in_schema=False)
        async def playground():
            """The chat playground: one self-contained page (no build step, no external assets)."""
            return HTMLResponse(page.replace("__MODEL__", html.escape(model_name)).replace("__NEEDS_KEY__", "true" if keys.enabled else "false"))

    @app.get("/version")
    async def version():
        return {"version": sieve.__version__}

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "sieve",
                                            "max_model_len": engine.config.max_model_len}]}

    @app.post("/v1/completions", dependencies=[Depends(require_api_key)])
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
        # echo with logprobs scores the prompt too (how evaluation harnesses get a loglikelihood)
        prompt_lp = body.prompt_logprobs
        if body.echo and body.logprobs is not None:
            prompt_lp = max(prompt_lp or 0, body.logprobs)
        params = _params(body, body.max_tokens, body.logprobs, prompt_lp)
        tenant_salt(raw, params)
        await _compile_grammar(params)
        prompts = body.prompts()
        if len(prompts) > max_prompts:
            raise APIError(400, f"{len(prompts)} prompts are over this server's limit of {max_prompts} per request "
                                "(--max-prompts-per-request)", param="prompt")
        _check_bytes(prompts)
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]  # token ids need no tokenizer: checked here
        prompts = [p if isinstance(p, str) else _encode_prompt(p) for p in prompts]
        for i, encoded in zip(texts, await asyncio.gather(*(off_loop(_encode_prompt, prompts[i]) for i in texts))):
            prompts[i] = encoded
        return await _serve(raw, body, prompts, params, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_api_key)])
    async def chat(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        if tokenizer is None:
            raise APIError(400, "this server has no tokenizer, so no chat template")
        n_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        _check_bytes([m.text() for m in body.messages], "messages")
        params = _params(body, body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
                         n_logprobs, body.prompt_logprobs)
        tenant_salt(raw, params)
        await _compile_grammar(params, "tool_choice" if body.tool_mode and body.tool_choice not in (None, "auto") else None)
        prompt = await off_loop(_render_chat, [m.template_dict() for m in body.messages], body.add_generation_prompt,
                                body.tools if body.tool_mode else None)
        return await _serve(raw, body, [prompt], params, chat=True)

    async def _compile_grammar(params, param: str | None = None) -> None:
        """Structured outputs: compile the request's grammar off the event loop and the engine thread (cached by its
        hash, so the engine only copies it) on a pool of --structured-outputs-compile-workers threads, within
        --structured-outputs-compile-timeout counted from when its compile starts (not while it waits behind others);
        the compile itself is bounded by the same deadline (llguidance's fuel), so it ends rather than holding its
        thread. A grammar that cannot compile, or not in time, is a 400."""
        spec = params.structured_outputs
        if spec is None:
            return
        param = param or "response_format"
        started = asyncio.Event()
        loop = asyncio.get_running_loop()

        def compile_now():
            loop.call_soon_threadsafe(started.set)
            return engine.grammars.compile(spec, deadline_s=grammar_timeout)

        future = loop.run_in_executor(grammar_pool, compile_now)
        try:
            await asyncio.wait({future, asyncio.ensure_future(started.wait())}, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.wait_for(asyncio.shield(future), grammar_timeout)
        except asyncio.TimeoutError:
            metrics.limit_refused("grammar_timeout")
            raise APIError(400, f"the {spec.kind} constraint did not compile within {grammar_timeout:g} s "
                                "(--structured-outputs-compile-timeout)", param=param, code="grammar_timeout") from None
        except GrammarError as e:
            raise APIError(400, str(e), param=param, code="invalid_grammar") from e

    async def off_loop(fn, *args):
        """Run `fn` on the tokenizer pool: tokenizing a long prompt or rendering a template blocks no one."""
        return await asyncio.get_running_loop().run_in_executor(tokenize_pool, fn, *args)

    def _check_length(ids: list[int]) -> None:
        if len(ids) > prompt_token_limit:
            raise APIError(400, f"the prompt is {len(ids)} tokens, over this server's limit of {prompt_token_limit} "
                                f"({'--max-prompt-tokens' if max_prompt_tokens else 'the context length'})", param="prompt",
                           code="context_length_exceeded")

    def _check_bytes(texts, param: str = "prompt") -> None:
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts if isinstance(t, str))
        if size > prompt_byte_limit:
            metrics.limit_refused("prompt_bytes")
            raise APIError(400, f"the prompt is {size} bytes, more than {prompt_byte_limit} (--max-prompt-bytes; the most "
                                f"that {prompt_token_limit} tokens can hold): refused before tokenizing", param=param,
                           code="context_length_exceeded")

    def _encode_prompt(prompt):
        """A text prompt becomes token ids here (the engine then only checks them); ids pass as they are."""
        if isinstance(prompt, str) and tokenizer is not None:
            prompt = {"prompt_token_ids": tokenizer.encode(prompt), "prompt": prompt}
        if isinstance(prompt, dict):
            _check_length(prompt["prompt_token_ids"])
        return prompt

    def _render_chat(messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> dict:
        try:
            messages, extra = render_messages(messages, tools, tokenizer)
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
        except Exception as e:
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from e
        ids = tokenizer.encode(text, add_special_tokens=False)
        _check_length(ids)
        return {"prompt_token_ids": ids, "prompt": text}

    @app.post("/v1/kv_transfer/release", dependencies=[Depends(require_api_key)])
    async def kv_release(body: dict):
        """A gateway gives back the blocks of a prefill this server exported (its own signed kv_transfer_params) when
        no decode server will take them, instead of leaving them held for the whole lease."""
        from sieve.distributed.kv_transfer import KVParamsError

        conn = getattr(engine, "kv_connector", None)
        if conn is None or conn.store is None:
            raise APIError(400, "this server exports no KV (start it with --role prefill or both)", param="kv_transfer_params")
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise APIError(400, "kv_transfer_params must be an object", param="kv_transfer_params")
        try:
            return {"released_blocks": conn.release(params)}
        except KVParamsError as e:
            raise APIError(400, f"kv_transfer_params: {e}", param="kv_transfer_params") from None

    @app.post("/tokenize", dependencies=[Depends(require_api_key)])
    async def tokenize(body: TokenizeRequest):
        """vLLM's /tokenize: a prompt, or chat messages through the template, to token ids."""
        check_model(body.model)
        if tokenizer is None:
            raise APIError(400, "this server has no tokenizer")
        if body.messages is not None:
            _check_bytes([m.text() for m in body.messages], "messages")
            prompt = await off_loop(_render_chat, [m.template_dict() for m in body.messages], body.add_generation_prompt)
            ids = prompt["prompt_token_ids"]
        else:
            _check_bytes([body.prompt])
            ids = await off_loop(lambda: tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
            _check_length(ids)
        return {"count": len(ids), "max_model_len": engine.config.max_model_len, "tokens": ids,
                "token_strs": [tokenizer.convert_ids_to_tokens(t) for t in ids] if body.return_token_strs else None}

    @app.post("/detokenize", dependencies=[Depends(require_api_key)])
    async def detokenize(body: DetokenizeRequest):
        """vLLM's /detokenize: token ids to text."""
        check_model(body.model)
        if tokenizer is None:
            raise APIError(400, "this server has no tokenizer")
        vocab = engine.arch.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range for vocabulary size {vocab}", param="tokens")
        return {"prompt": await off_loop(tokenizer.decode, body.tokens)}

    keyed = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/kv_transfer/release"} | (set() if metrics_public else {"/metrics"})
    document(app, protected=keyed if keys.enabled else set())

    def _params(body, max_tokens, logprobs, prompt_logprobs):
        field = body.unsupported()
        if field is not None:
            raise APIError(400, f"`{field}` is not supported by this server", param=field, code="unsupported_field")
        broken = body.invalid()
        if broken is not None:
            raise APIError(400, broken[1], param=broken[0])
        if body.n > max_n:
            raise APIError(400, f"n = {body.n} is over this server's limit of {max_n} choices (--max-n)", param="n")
        kv = body.kv_transfer_params
        if isinstance(kv, dict) and kv.get("do_remote_prefill") and isinstance(getattr(body, "prompt", None), list) \
                and len(body.prompts()) > 1:
            raise APIError(400, "kv_transfer_params.do_remote_prefill carries one prompt's KV: send one prompt",
                           param="kv_transfer_params")
        if body.stream and isinstance(body.kv_transfer_params, dict) and body.kv_transfer_params.get("do_remote_decode"):
            raise APIError(400, "kv_transfer_params.do_remote_decode answers with the params a decode server needs: "
                           "it needs stream false", param="kv_transfer_params")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > limits.max_stop_strings or any(len(x) > limits.max_stop_string_chars for x in stops):
            metrics.limit_refused("stop")
            raise APIError(400, f"stop takes at most {limits.max_stop_strings} strings of at most {limits.max_stop_string_chars} "
                                "characters (--max-stop-strings, --max-stop-string-chars)", param="stop")
        if len(body.logit_bias or {}) > limits.max_logit_bias:
            metrics.limit_refused("logit_bias")
            raise APIError(400, f"logit_bias takes at most {limits.max_logit_bias} tokens (--max-logit-bias)", param="logit_bias")
        if "priority" in body.model_fields_set and not allow_client_priority:
            raise APIError(400, "`priority` is honoured only when the server runs with --allow-client-priority", param="priority",
                           code="unsupported_field")
        try:
            return body.sampling_params(max_tokens, logprobs, prompt_logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    async def _serve(raw: Request, body, prompts: list, params, chat: bool):
        if max_waiting is not None and engine.num_waiting + aengine.num_pending >= max_waiting:
            metrics.rejected.inc()
            raise APIError(429, f"the server is at capacity ({max_waiting} requests waiting); retry shortly",
                           "rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"})
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        # Every prompt of the request is admitted at once: they share the next step (the engine gives each
        # its own copy of the sampling parameters).
        try:
            gens = await aengine.submit([(f"{rid}-{i}", prompt, params, body.priority) for i, prompt in enumerate(prompts)])
        except (RequestError, EngineError) as e:
            raise _as_api_error(e) from e
        try:
            # the first output of each (a failed step before it is still an HTTP error, not a broken stream)
            firsts = await asyncio.gather(*(g.__anext__() for g in gens))
        except BaseException as e:
            for g in gens:
                await g.aclose()
            if isinstance(e, EngineError):
                raise _as_api_error(e) from e
            raise
        streams = list(zip(gens, firsts))
        if body.stream:
            return StreamingResponse(
                _stream(raw, rid, created, streams, params.n, chat, body, params.logprobs or 0), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )

        async def collect(gen, first):
            last = first
            async for out in gen:
                last = out
            return last

        task = asyncio.ensure_future(asyncio.gather(*(collect(g, f) for g, f in streams)))
        try:
            while not task.done():  # a client that goes away aborts its request at once
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await raw.is_disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    return Response(status_code=499)
            finals = task.result()
        except EngineError as e:  # the engine failed this request after admitting it
            raise _as_api_error(e) from e
        finally:
            for g in gens:  # aborts whatever has not finished (a no-op for the rest)
                await g.aclose()
        return _full_response(rid, created, finals, params.n, chat, body, params.logprobs or 0)

    def _as_api_error(e: Exception) -> APIError:
        if isinstance(e, EngineError):
            return APIError(503 if aengine.error is not None else 500, str(e), "server_error", code="engine_error")
        if isinstance(e, ServerBusy):
            return APIError(503, str(e), "server_error", code="server_busy", headers={"Retry-After": "1"})
        message = str(e)
        param = "kv_transfer_params" if message.startswith("kv_transfer_params") else \
            "prompt" if "prompt" in message or "context" in message else None
        return APIError(400, message, param=param)

    async def _stream(raw, rid, created, streams, n, chat, body, n_top) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        cached_tokens = 0

        def chunk(choices):
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices}) + "\n\n"

        async def pump(p_idx: int, gen, first, queue: asyncio.Queue) -> None:
            await queue.put((p_idx, first))
            if not first.finished:
                try:
                    async for out in gen:
                        await queue.put((p_idx, out))
                except EngineError as e:  # handed to the stream, which tells the client
                    await queue.put((p_idx, e))

        # Bounded: a client that stops reading stops the pumps, and its outputs pile up in the engine's queue for
        # the request, whose backlog limit then ends it (--max-stream-backlog)
        queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(streams))
        pumps: list[asyncio.Task] = []
        parsers = {} if chat and getattr(body, "tool_mode", False) else None  # choice index -> ToolCallParser
        first_chunk = [set(range(n)) for _ in streams]  # choices whose prompt_logprobs are still to be sent
        try:
            for p_idx, (gen, first) in enumerate(streams):
                for i in range(n):  # opening chunk per choice: the role (chat) or the echoed prompt
                    if chat:
                        yield chunk([{"index": p_idx * n + i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
                    elif getattr(body, "echo", False):
                        lp = _prompt_logprobs_openai(first, n_top) if body.logprobs is not None else None
                        yield chunk([{"index": p_idx * n + i, "text": _prompt_text(first), "logprobs": lp, "finish_reason": None}])
            # the prompts of one request generate together; their chunks interleave as they come
            pumps = [asyncio.create_task(pump(i, gen, first, queue)) for i, (gen, first) in enumerate(streams)]
            remaining = len(streams)
            while remaining:
                p_idx, out = await queue.get()
                if isinstance(out, EngineError):  # an error event, then [DONE]: the client is told, never left waiting
                    yield "data: " + json.dumps({"error": {"message": str(out), "type": "server_error", "param": None,
                                                           "code": "engine_error"}}) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
                echo = len(_prompt_text(out)) if getattr(body, "echo", False) else 0
                for c, (text, ids) in zip(out.outputs, out.deltas):  # one chunk per choice per step, as OpenAI
                    if not (text or ids or c.finish_reason):
                        continue
                    lp = _logprobs(c, len(c.token_ids) - len(ids), chat, n_top, echo + len(c.text) - len(text)) \
                        if c.logprobs is not None else None
                    idx = p_idx * n + c.index
                    if chat and parsers is not None:  # tools offered: calls leave the content as they complete
                        parser = parsers.setdefault(idx, ToolCallParser(tool_names(body.tools), body.parallel_tool_calls is not False))
                        content, calls = parser.feed(text)
                        if c.finish_reason:
                            content += parser.finish()
                        delta = {"content": content} if content else {}
                        if calls:
                            delta["tool_calls"] = calls
                        reason = "tool_calls" if c.finish_reason == "stop" and parser.calls else c.finish_reason
                        yield chunk([{"index": idx, "delta": delta, "logprobs": lp, "finish_reason": reason}])
                    elif chat:
                        yield chunk([{"index": idx, "delta": {"content": text} if text else {}, "logprobs": lp, "finish_reason": c.finish_reason}])
                    else:
                        extra = {"prompt_logprobs": _prompt_logprobs_vllm(out)} if body.prompt_logprobs is not None and c.index in first_chunk[p_idx] else {}
                        first_chunk[p_idx].discard(c.index)
                        yield chunk([{"index": idx, "text": text, "logprobs": lp, "finish_reason": c.finish_reason, **extra}])
                if out.finished:
                    remaining -= 1
                    usage["prompt_tokens"] += len(out.prompt_token_ids)
                    usage["completion_tokens"] += sum(len(c.token_ids) for c in out.outputs)
                    cached_tokens += out.num_cached_tokens
                elif await raw.is_disconnected():
                    return
            if body.stream_options and body.stream_options.include_usage:
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens if report_cached else 0}
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name, "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            for task in pumps:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for gen, _ in streams:  # aborts whatever has not finished (the client went away)
                await gen.aclose()

    def _full_response(rid, created, finals: list[RequestOutput], n, chat, body, n_top):
        choices, prompt_tokens, completion_tokens = [], 0, 0
        echo = getattr(body, "echo", False)
        for p_idx, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                if chat:
                    lp = _logprobs(c, 0, chat, n_top) if c.logprobs is not None else None
                    message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
                    if getattr(body, "tool_mode", False):
                        message["content"], calls = parse_tool_calls(c.text, tool_names(body.tools), body.parallel_tool_calls is not False)
                        if calls:
                            message["tool_calls"] = calls
                            reason = "tool_calls" if reason == "stop" else reason
                    choices.append({"index": p_idx * n + c.index, "message": message, "logprobs": lp, "finish_reason": reason})
                    continue
                prefix = _prompt_text(out) if echo else ""
                lp = _logprobs(c, 0, chat, n_top, len(prefix)) if c.logprobs is not None else None
                if echo and body.logprobs is not None:  # the prompt's tokens first, scored by the tokens before them
                    scored = _prompt_logprobs_openai(out, n_top)
                    lp = {k: scored[k] + v for k, v in lp.items()} if lp is not None else scored  # max_tokens 0: the prompt alone
                choice = {"index": p_idx * n + c.index, "text": prefix + c.text, "logprobs": lp, "finish_reason": c.finish_reason}
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs_vllm(out)
                choices.append(choice)
        extra = {"prompt_logprobs": _prompt_logprobs_vllm(finals[0])} if chat and body.prompt_logprobs is not None else {}
        if finals[0].kv_transfer_params is not None:  # a prefill server's answer: where the decode server finds the KV
            extra["kv_transfer_params"] = finals[0].kv_transfer_params
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created, "model": model_name,
                "choices": choices, **extra,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens,
                          "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in finals) if report_cached else 0}}}

    def _decode(ids: list[int]) -> str:
        return tokenizer.decode(ids) if tokenizer is not None else ""

    def _token_str(t: int) -> str:
        return tokenizer.decode([t]) if tokenizer is not None else f"token_id:{t}"

    def _prompt_text(out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else _decode(out.prompt_token_ids)

    def _prompt_logprobs_openai(out: RequestOutput, n_top: int) -> dict:
        """The legacy completions shape for the prompt's tokens (as `echo` returns them): the first token
        has no logprob (null), every later one its own and the top `n_top`."""
        tokens = [_token_str(t) for t in out.prompt_token_ids]
        logprobs, tops = [None], [None]
        for t, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
            logprobs.append(lp[t].logprob)
            tops.append({_token_str(k): v.logprob for k, v in lp.items() if v.rank <= n_top or k == t})
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": _offsets(tokens, 0)}

    def _prompt_logprobs_vllm(out: RequestOutput) -> list:
        """vLLM's `prompt_logprobs`: per prompt token, null for the first, then {token id: {logprob, rank, decoded_token}}."""
        return [None if lp is None else {str(k): {"logprob": v.logprob, "rank": v.rank, "decoded_token": _token_str(k)}
                                         for k, v in lp.items()} for lp in out.prompt_logprobs]

    def _offsets(tokens: list[str], base: int) -> list[int]:
        offsets, pos = [], base
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return offsets

    def _logprobs(c, start: int, chat: bool, n_top: int, text_base: int = 0) -> dict:
        """OpenAI logprobs for tokens [start:] of choice `c`: the chosen token's and the top `n_top`; `text_base`:
        where these tokens' text begins in the choice's text (`text_offset`)."""
        ids, lps = c.token_ids[start:], c.logprobs[start:]
        if chat:
            def entry(t, logprob):
                s = _token_str(t)
                return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

            return {"content": [
                {**entry(t, lp[t].logprob),
                 "top_logprobs": [entry(k, v.logprob) for k, v in sorted(lp.items(), key=lambda kv: kv[1].rank) if v.rank <= n_top]}
                for t, lp in zip(ids, lps)
            ]}
        tokens = [_token_str(t) for t in ids]
        return {"tokens": tokens, "token_logprobs": [lp[t].logprob for t, lp in zip(ids, lps)],
                "top_logprobs": [{_token_str(k): v.logprob for k, v in lp.items()} for lp in lps], "text_offset": _offsets(tokens, text_base)}

    return app
