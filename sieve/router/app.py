"""`sieve router`: the one gateway process in front of OpenAI-compatible backends.

request -> route (the model name: a backend, an alias or route:<policy>) -> response cache -> policy -> backend(s)
        -> response (`model` says which backend answered; x-sieve-route, x-sieve-route-score, x-sieve-route-policy,
           x-sieve-route-reason and x-sieve-cache say why)

Backends are health-checked in the background; a routed request whose backend cannot be reached goes to the
other one of the pair (reason `fallback`), a direct one gets a 502 in OpenAI's error shape. A backend's own
4xx passes through unchanged. One request's path is sieve/router/gateway.py; calls to backends,
sieve/router/upstream.py."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import sieve
from sieve.router.balance import Balancer
from sieve.router.cache import MemoryStore, RedisStore, ResponseCache, SemanticIndex
from sieve.router.classifier import Classifier
from sieve.router.config import RouterConfig
from sieve.router.gateway import Gateway
from sieve.router.metrics import GatewayMetrics
from sieve.router.upstream import Upstream
from sieve.server.auth import APIKeys
from sieve.server.errors import BodyLimit, install_error_handlers


def make_cache(config: RouterConfig, classifier: Classifier | None) -> ResponseCache | None:
    cc = config.cache
    if cc.backend == "none":
        return None
    store = RedisStore(cc.redis_url) if cc.backend == "redis" else MemoryStore(cc.max_entries)
    semantic = None
    if cc.semantic_threshold is not None:
        semantic = SemanticIndex(cc.semantic_threshold, classifier.embedder if classifier else None, cc.max_entries)
    return ResponseCache(store, cc.ttl, cc.stale_while_revalidate, cc.cache_sampled, semantic)


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


routes = APIRouter()


@routes.post("/v1/chat/completions")
async def chat(request: Request):
    return await gateway(request).handle("chat", request)


@routes.post("/v1/completions")
async def completions(request: Request):
    return await gateway(request).handle("completions", request)


@routes.get("/v1/models")
async def models(request: Request):
    gw = gateway(request)
    gw.tenant_of(request)
    config = gw.config
    data = [{"id": b.name, "object": "model", "owned_by": "sieve-router", "version": b.version,
             "cost_per_token": b.cost_per_token, "replicas": len(b.urls)} for b in config.backends.values()]
    data += [{"id": alias, "object": "model", "owned_by": "sieve-router", "route": target} for alias, target in config.aliases.items()]
    if config.weak and config.strong:
        data += [{"id": f"route:{p}", "object": "model", "owned_by": "sieve-router"} for p in ("learned", "cascade", "budget")]
    return {"object": "list", "data": data}


@routes.get("/health")
async def health_check(request: Request):
    """Open to anyone: up or not. The backends' URLs only to a client with a key (or on an open gateway)."""
    gw = gateway(request)
    health = gw.upstream.health
    status = 200 if any(health.values()) else 503
    answer = {"status": "ok" if status == 200 else "unavailable"}
    if not gw.keys.enabled or gw.keys.tenant(request.headers.get("authorization")) is not None:
        answer["backends"] = {name: {url: health[url] for url in b.urls} for name, b in gw.config.backends.items()}
    return JSONResponse(answer, status_code=status)


@routes.get("/metrics")
async def metrics(request: Request):
    gw = gateway(request)
    gw.tenant_of(request)
    return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_router_app(config: RouterConfig, classifier: Classifier | None = None) -> FastAPI:
    cache = make_cache(config, classifier)
    health = {url: True for b in config.backends.values() for url in (*b.urls, *b.prefill)}  # per replica URL
    balancers = {name: Balancer(b.urls, config.balance, config.balance_abs) for name, b in config.backends.items()}
    metrics = GatewayMetrics(config.backends, health, balancers, cache)
    upstream = Upstream(config, metrics, health, balancers)
    gw = Gateway(config, classifier, cache, APIKeys(config.api_keys), upstream, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        upstream.open()
        checker = asyncio.create_task(upstream.check_health())
        yield
        checker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await checker
        await upstream.close()
        if cache is not None:
            await cache.store.close()

    app = FastAPI(title="sieve router", version=sieve.__version__, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    install_error_handlers(app, "routing a request")
    app.state.gateway = gw
    app.state.cache = cache
    app.state.health = health
    app.state.balancers = balancers
    app.include_router(routes)
    return app
