"""The OpenAI-compatible HTTP server: `create_app` puts an engine behind the routes of sieve/server/routes.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

import sieve
from sieve.engine import LLMEngine
from sieve.pooling import POOLING
from sieve.server.async_engine import AsyncEngine
from sieve.server.auth import APIKeys
from sieve.server.batch_routes import BATCH_PATHS, batch_api
from sieve.server.batch_runner import BatchRunner
from sieve.server.batch_store import BatchStore
from sieve.server.errors import BodyLimit, install_error_handlers
from sieve.server.messages_routes import MESSAGES_PATHS, messages_api
from sieve.server.lora_routes import LORA_PATHS, lora_api
from sieve.server.responses_routes import RESPONSES_PATHS, responses_api
from sieve.server.openapi import document
from sieve.server.routes import KEYED, api, playground_page, public
from sieve.server.state import ServerLimits, ServerOptions, ServerState
from sieve.server.tenants import Tenants

__all__ = ["ServerLimits", "create_app"]


def create_app(engine: LLMEngine | Callable[[], LLMEngine], served_model_name: str | None = None, api_key: str | APIKeys | None = None,
               max_waiting: int | None = None, allow_client_priority: bool = False, metrics_public: bool = False,
               health_stall_seconds: float = 60.0, max_n: int = 128, max_prompts: int = 64,
               max_body_bytes: int = 16 << 20, max_prompt_tokens: int | None = None, tokenizer_workers: int = 1,
               grammar_timeout: float = 10.0, webui: bool = True, limits: ServerLimits | None = None,
               shared_prefix_cache: bool = False, tenants: Tenants | None = None, batch_dir: str | None = None,
               embedding_pooling: str = "mean", max_stored_responses: int = 1000, lora_dir: str | None = None) -> FastAPI:
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
    and then no response reports cached_tokens (a hit may be another tenant's). `tenants` (sieve/server/tenants.py):
    every key's tenant with its tier and limits, in place of `api_key`. `batch_dir`: the Batch API's files, batches
    and results (SQLite), run in the capacity interactive requests leave. `embedding_pooling`: how /v1/embeddings pools
    the final hidden states, "mean" or "last" (sieve/pooling.py). `max_stored_responses`: how many Responses API
    responses are kept (in memory) for GET and `previous_response_id`. `lora_dir`: the folder /v1/load_lora_adapter may
    read adapters from (None: adapters are loaded only at start)."""
    if embedding_pooling not in POOLING:
        raise ValueError(f"embedding_pooling must be one of {', '.join(POOLING)}, got {embedding_pooling!r}")
    options = ServerOptions(served_model_name, max_waiting, allow_client_priority, metrics_public, health_stall_seconds, max_n,
                            max_prompts, max_body_bytes, max_prompt_tokens, tokenizer_workers, grammar_timeout, webui,
                            limits or ServerLimits(), shared_prefix_cache, tenants, embedding_pooling, max_stored_responses,
                            lora_dir)
    if tenants is not None and (api_key.enabled if isinstance(api_key, APIKeys) else api_key):
        raise ValueError("give API keys either in the tenants file or as api keys, not both")
    aengine = AsyncEngine(engine, max_backlog=options.limits.max_stream_backlog)
    keys = tenants.keys if tenants is not None else \
        api_key if isinstance(api_key, APIKeys) else APIKeys({api_key: "default"} if api_key else {})
    st = ServerState(aengine, keys, options)
    # a full queue's Retry-After: when its head should start
    st.engine.track_queue_head = max_waiting is not None or (tenants is not None and tenants.caps_waiting)
    aengine.on_finished = st.finished
    aengine.on_slow_reader = lambda rid: st.metrics.limit_refused("stream_backlog")
    runner = None

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(runner.run()) if runner is not None else None
        yield
        if task is not None:
            await runner.stop(task)
        aengine.stop()  # (the tokenizer pool lives as long as the app: its idle threads end with the process)

    app = FastAPI(title="sieve", version=sieve.__version__, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    install_error_handlers(app)
    app.state.sieve = st
    app.state.async_engine = aengine
    app.include_router(public)
    if webui:
        app.include_router(playground_page)
    app.include_router(api)
    app.include_router(batch_api)
    app.include_router(messages_api)
    app.include_router(responses_api)
    app.include_router(lora_api)
    if batch_dir is not None:
        st.batches = BatchStore(batch_dir)
        runner = app.state.batch_runner = BatchRunner(st.batches, app, st.engine, aengine, st.internal_secret)
    document(app, protected=(KEYED | BATCH_PATHS | MESSAGES_PATHS | RESPONSES_PATHS | LORA_PATHS | (set() if metrics_public else {"/metrics"})) if keys.enabled else set())
    return app
