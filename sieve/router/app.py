"""`sieve router`: the one gateway process in front of OpenAI-compatible backends.

request -> route (the model name: a backend, an alias or route:<policy>) -> response cache -> policy -> backend(s)
        -> response (`model` says which backend answered; x-sieve-route, x-sieve-route-score, x-sieve-route-policy,
           x-sieve-route-reason and x-sieve-cache say why)

Backends are health-checked in the background; a routed request whose backend cannot be reached goes to the
other one of the pair (reason `fallback`), a direct one gets a 502 in OpenAI's error shape. A backend's own
4xx passes through unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

import sieve
from sieve.router import policy as P
from sieve.router.balance import Balancer, prompt_blocks
from sieve.router.cache import Entry, MemoryStore, RedisStore, ResponseCache, SemanticIndex, cache_key
from sieve.router.classifier import Classifier
from sieve.router.config import Backend, RouterConfig
from sieve.router.stream import assemble, replay
from sieve.server.app import BodyLimit
from sieve.server.auth import APIKeys

log = logging.getLogger("sieve.router")

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class GatewayError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, body: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.body = body  # a backend's own error object, passed through

    def response(self) -> JSONResponse:
        body = self.body or error_body(self.message, self.type, self.param, self.code)
        return JSONResponse(body, status_code=self.status)


class _ReplicaDown(Exception):
    pass


class BackendDown(Exception):
    def __init__(self, backend: Backend, why: str):
        super().__init__(f"backend {backend.name} is unavailable: {why}")
        self.backend = backend


@dataclass
class Decision:
    backend: Backend
    policy: str
    score: float | None = None
    reason: str = ""

    def headers(self) -> dict[str, str]:
        h = {"x-sieve-route": self.backend.name, "x-sieve-route-policy": self.policy}
        if self.score is not None:
            h["x-sieve-route-score"] = f"{self.score:.6g}"
        if self.reason:
            h["x-sieve-route-reason"] = self.reason
        return h


class _CacheCollector:
    def __init__(self, cache: ResponseCache):
        self.cache = cache

    def collect(self):
        c = CounterMetricFamily("sieve:router_cache_events", "Response cache lookups by outcome, and store errors", labels=["event"])
        for event, n in self.cache.stats.items():
            c.add_metric([event], n)
        yield c


class _BackendCollector:
    def __init__(self, backends: dict[str, Backend], health: dict[str, bool], balancers: dict[str, Balancer]):
        self.backends, self.health, self.balancers = backends, health, balancers

    def collect(self):
        up = GaugeMetricFamily("sieve:router_backend_up", "1 when the replica answered its last health check (or call)",
                               labels=["backend", "replica"])
        inflight = GaugeMetricFamily("sieve:router_replica_requests_in_flight", "Requests the gateway has in flight on the replica",
                                     labels=["backend", "replica"])
        blocks = CounterMetricFamily("sieve:router_prefix_blocks", "Prompt blocks sent to replicas, and those the chosen replica "
                                     "had already been sent (matched / total: the routing's prefix hit rate)", labels=["backend", "kind"])
        for name, b in self.backends.items():
            bal = self.balancers[name]
            for url in b.urls:
                up.add_metric([name, url], 1.0 if self.health[url] else 0.0)
                inflight.add_metric([name, url], bal.inflight[url])
            blocks.add_metric([name, "matched"], bal.matched_blocks)
            blocks.add_metric([name, "total"], bal.total_blocks)
        yield up
        yield inflight
        yield blocks


def _make_cache(config: RouterConfig, classifier: Classifier | None) -> ResponseCache | None:
    cc = config.cache
    if cc.backend == "none":
        return None
    store = RedisStore(cc.redis_url) if cc.backend == "redis" else MemoryStore(cc.max_entries)
    semantic = None
    if cc.semantic_threshold is not None:
        semantic = SemanticIndex(cc.semantic_threshold, classifier.embedder if classifier else None, cc.max_entries)
    return ResponseCache(store, cc.ttl, cc.stale_while_revalidate, cc.cache_sampled, semantic)


def create_router_app(config: RouterConfig, classifier: Classifier | None = None) -> FastAPI:
    backends = config.backends
    names = set(backends)
    cache = _make_cache(config, classifier)
    health = {url: True for b in backends.values() for url in (*b.urls, *b.prefill)}  # per replica URL
    balancers = {name: Balancer(b.urls, config.balance, config.balance_abs) for name, b in backends.items()}
    state: dict = {}

    registry = CollectorRegistry()
    requests_total = Counter("sieve:router_requests", "Requests answered, by policy and the backend that answered",
                             ["policy", "backend"], registry=registry)
    cascade_total = Counter("sieve:router_cascade_decisions", "Cascade outcomes", ["decision"], registry=registry)
    upstream_errors = Counter("sieve:router_upstream_errors", "Backend calls that failed (unreachable or 5xx)", ["backend"], registry=registry)
    picks = Counter("sieve:router_replica_picks", "Replica choices, by reason (prefix: affinity; load: least loaded; "
                    "round_robin; only: one candidate)", ["backend", "replica", "reason"], registry=registry)
    budget_tokens = Counter("sieve:router_budget_tokens", "max_tokens granted by the budget policy", registry=registry)
    pd_total = Counter("sieve:router_pd_requests", "Disaggregated requests: prefilled remotely (transferred), or decoded "
                       "from scratch because no prefill server answered (prefill_failed)", ["backend", "outcome"], registry=registry)
    pd_seconds = Histogram("sieve:router_pd_prefill_seconds", "Time of the prefill leg of a disaggregated request", registry=registry,
                           buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
    prefill_turn = {"next": 0}
    latency = Histogram("sieve:router_request_latency_seconds", "Gateway latency (to the response, or to the first byte of a stream)",
                        ["cache"], registry=registry, buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
    if cache is not None:
        registry.register(_CacheCollector(cache))
    registry.register(_BackendCollector(backends, health, balancers))

    async def check_health() -> None:
        client: httpx.AsyncClient = state["client"]
        while True:
            for b in backends.values():
                for url in (*b.urls, *b.prefill):
                    try:  # the server's own /health: /v1/models answers 200 while its engine is stalled or dead
                        r = await client.get(_root(url) + "/health", headers=_auth(b), timeout=min(5.0, config.health_interval))
                        up = r.status_code == 200
                    except httpx.HTTPError:
                        up = False
                    if up != health[url]:
                        log.warning("backend %s replica %s is %s", b.name, url, "up again" if up else "down")
                    health[url] = up
            await asyncio.sleep(config.health_interval)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(config.timeout, connect=5.0))
        checker = asyncio.create_task(check_health())
        yield
        checker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await checker
        await state["client"].aclose()
        if cache is not None:
            await cache.store.close()

    app = FastAPI(title="sieve router", version=sieve.__version__, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.state.cache = cache
    app.state.health = health
    app.state.balancers = balancers
    keys = APIKeys(config.api_keys)

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, e: GatewayError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error"),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):  # a bug must still answer in the OpenAI shape
        log.exception("unhandled error in the gateway")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500)

    def tenant_of(request: Request) -> str:
        """The client's tenant (its key's); every route but /health calls this. Open gateways have one tenant."""
        if not keys.enabled:
            return ""
        tenant = keys.tenant(request.headers.get("authorization"))
        if tenant is None:
            raise GatewayError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        return tenant

    # ---- calls to backends -------------------------------------------------------------------
    async def on_replicas(backend: Backend, body: dict, send):
        """`send(url)` on the replica the balancer picks; a replica that cannot be reached (or answers 5xx) is
        marked down and the next one is tried, so a dead replica costs its requests nothing but a retry."""
        bal = balancers[backend.name]
        blocks = await asyncio.to_thread(prompt_blocks, body) if bal.policy == "cache_aware" else []  # off the event loop
        tried: list[str] = []
        errors = []
        while len(tried) < len(backend.urls):
            rest = [u for u in backend.urls if u not in tried]
            url, reason = bal.pick(blocks, [u for u in rest if health[u]] or rest)
            tried.append(url)
            bal.inflight[url] += 1
            try:
                result = await send(url)
            except _ReplicaDown as e:
                bal.inflight[url] -= 1
                health[url] = False
                upstream_errors.labels(backend.name).inc()
                errors.append(f"{url}: {e}")
                continue
            except BaseException:
                bal.inflight[url] -= 1
                raise
            picks.labels(backend.name, url, reason).inc()
            bal.sent(url, blocks)
            return url, result
        raise BackendDown(backend, "; ".join(errors))

    async def call(backend: Backend, kind: str, body: dict) -> dict:
        """One non-streamed call; BackendDown when no replica answers; GatewayError (passed through) on 4xx."""
        body = dict(body, model=backend.upstream_model, stream=False)
        body.pop("stream_options", None)

        async def send(url: str) -> httpx.Response:
            try:
                r = await state["client"].post(f"{url}/{_path(kind)}", json=body, headers=_auth(backend))
            except httpx.TransportError as e:
                raise _ReplicaDown(f"{type(e).__name__}: {e}") from e
            if r.status_code == 503:  # unavailable: another replica may answer. A 500 (a step that failed) is not
                raise _ReplicaDown(f"HTTP {r.status_code}: {r.text[:200]}")  # retried: it would fail its batch there too
            return r

        url, r = await on_replicas(backend, body, send)
        balancers[backend.name].inflight[url] -= 1
        try:
            payload = r.json()
        except ValueError:
            upstream_errors.labels(backend.name).inc()
            raise BackendDown(backend, f"{url}: the response is not JSON") from None
        if r.status_code != 200:
            if r.status_code >= 500:
                upstream_errors.labels(backend.name).inc()
            raise GatewayError(r.status_code, "", body=payload if isinstance(payload, dict) and "error" in payload else
                               error_body(str(payload), "upstream_error"))
        payload["model"] = backend.name
        return payload

    async def prefill_first(backend: Backend, kind: str, body: dict) -> tuple[dict, tuple[str, dict] | None]:
        """Prefill/decode disaggregation (vLLM's proxy contract): the prompt runs on a prefill server with max_tokens
        1 and kv_transfer_params {"do_remote_decode": true}; its answer's kv_transfer_params go with the request to the
        decode server. No prefill server answering is no error: the decode server then computes the prompt itself.
        Returns the body for the decode server, and (prefill server, its params) when blocks were exported."""
        started = time.perf_counter()
        leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens", "n")}
        leg.update(model=backend.upstream_model, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        urls = list(backend.prefill)
        first = prefill_turn["next"] % len(urls)
        prefill_turn["next"] += 1
        order = urls[first:] + urls[:first]
        for url in [u for u in order if health[u]] + [u for u in order if not health[u]]:
            try:
                r = await state["client"].post(f"{url}/{_path(kind)}", json=leg, headers=_auth(backend))
                params = r.json().get("kv_transfer_params") if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError) as e:
                health[url] = False
                upstream_errors.labels(backend.name).inc()
                log.warning("prefill server %s: %s", url, e)
                continue
            if r.status_code >= 500:
                health[url] = False
                upstream_errors.labels(backend.name).inc()
                continue
            if r.status_code != 200:  # the request itself is bad: the decode server will say why
                break
            if isinstance(params, dict):
                pd_total.labels(backend.name, "transferred").inc()
                pd_seconds.observe(time.perf_counter() - started)
                return dict(body, kv_transfer_params=params), (url, params)
        pd_total.labels(backend.name, "prefill_failed").inc()
        return body, None

    async def release_exported(backend: Backend, issued: tuple[str, dict] | None) -> None:
        """The decode leg refused or failed: the prefill server gives its exported blocks back now, not at lease end."""
        if issued is None:
            return
        url, params = issued
        try:
            r = await state["client"].post(f"{url}/kv_transfer/release", json={"kv_transfer_params": params}, headers=_auth(backend))
            if r.status_code != 200:
                log.warning("prefill server %s did not release its blocks: HTTP %d %s", url, r.status_code, r.text[:200])
        except httpx.HTTPError as e:
            log.warning("prefill server %s did not release its blocks: %s", url, e)

    async def open_stream(backend: Backend, kind: str, body: dict) -> tuple[httpx.Response, callable]:
        """The upstream stream, open and 200, and the function that releases its replica when it ends."""
        body = dict(body, model=backend.upstream_model, stream=True)

        async def send(url: str) -> httpx.Response:
            req = state["client"].build_request("POST", f"{url}/{_path(kind)}", json=body, headers=_auth(backend))
            try:
                r = await state["client"].send(req, stream=True)
            except httpx.TransportError as e:
                raise _ReplicaDown(f"{type(e).__name__}: {e}") from e
            if r.status_code == 503:
                text = (await r.aread()).decode(errors="replace")
                await r.aclose()
                raise _ReplicaDown(f"HTTP {r.status_code}: {text[:200]}")
            return r

        url, r = await on_replicas(backend, body, send)
        bal = balancers[backend.name]
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                bal.inflight[url] -= 1

        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            await r.aclose()
            release()
            try:
                payload = json.loads(text)
            except ValueError:
                payload = error_body(text, "upstream_error")
            raise GatewayError(r.status_code, "", body=payload)
        return r, release

    # ---- policies ------------------------------------------------------------------------------
    def other(backend: Backend) -> Backend | None:
        if config.weak is None or config.strong is None:
            return None
        weak, strong = config.pair()
        return strong if backend.name == weak.name else weak if backend.name == strong.name else None

    async def decide(route: P.Route, body: dict) -> tuple[Decision, dict]:
        """The backend a non-cascade route picks, and the body to send it."""
        if route.policy == "backend":
            return Decision(backends[route.backend], "direct"), body
        weak, strong = _pair(config)
        if route.policy == "learned":
            if classifier is None:
                raise GatewayError(400, "route:learned needs a classifier: start the router with --classifier FILE "
                                        "(written by `sieve router train`)", param="model", code="route_unavailable")
            threshold = route.threshold if route.threshold is not None else classifier.threshold_for_share(route.share)
            text = P.prompt_text(body)
            score = (await asyncio.get_running_loop().run_in_executor(None, classifier.scores, [text]))[0]
            chosen = strong if score >= threshold else weak
            return Decision(chosen, "learned", score, f"score {'>=' if chosen is strong else '<'} threshold {threshold:.4g}"), body
        if route.policy == "budget":
            effort = body.get("reasoning_effort")
            try:
                budget = P.estimate_budget(P.prompt_text(body), effort)
            except P.RouteError as e:
                raise GatewayError(400, str(e), param="reasoning_effort") from None
            new = P.apply_budget({k: v for k, v in body.items() if k != "reasoning_effort"}, budget, route.mode)
            budget_tokens.inc(budget)
            target = backends[route.backend] if route.backend else strong
            return Decision(target, "budget", float(budget), f"{route.mode} budget {budget} tokens"), new
        raise AssertionError(route.policy)

    async def cascade(route: P.Route, kind: str, body: dict) -> tuple[Decision, dict | None, dict | None]:
        """(decision, the weak answer when it stands, else None; the weak answer either way, when there is one):
        an escalated request goes to the strong backend, and falls back to the weak answer if it cannot."""
        weak, strong = _pair(config)
        if (body.get("n") or 1) != 1:
            raise GatewayError(400, "route:cascade decides on one answer: n must be 1", param="n")
        probe = dict(body)
        if kind == "chat":
            probe["logprobs"] = True
            probe["top_logprobs"] = max(int(body.get("top_logprobs") or 0), 20 if route.metric == "entropy" else 0)
        else:
            probe["logprobs"] = max(int(body.get("logprobs") or 0), 20 if route.metric == "entropy" else 1)
        try:
            answer = await call(weak, kind, probe)
        except BackendDown as e:
            log.warning("%s; the cascade escalates", e)
            cascade_total.labels("weak_unavailable").inc()
            return Decision(strong, "cascade", None, "fallback: weak backend unavailable"), None, None
        choice = (answer.get("choices") or [{}])[0]
        score = P.confidence(choice, route.metric)
        op = "<=" if route.metric == "entropy" else ">="
        _strip_logprobs(answer, kind, body)
        if P.accept(score, route.metric, route.threshold):
            cascade_total.labels("accept").inc()
            return Decision(weak, "cascade", score, f"accepted: {route.metric} {op} {route.threshold:g}"), answer, answer
        cascade_total.labels("escalate").inc()
        return Decision(strong, "cascade", score, f"escalated: not {route.metric} {op} {route.threshold:g}"), None, answer

    # ---- one request ---------------------------------------------------------------------------
    async def handle(kind: str, request: Request) -> Response:
        started = time.perf_counter()
        tenant = tenant_of(request)
        raw = await request.body()
        try:  # parsed and hashed off the event loop: a 16 MB body stalls no other client
            body = await asyncio.to_thread(json.loads, raw)
        except (ValueError, RecursionError):
            raise GatewayError(400, "the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "the body must be a JSON object")
        check_body(kind, body)
        if "kv_transfer_params" in body:
            raise GatewayError(400, "kv_transfer_params pass between the gateway's prefill and decode servers; clients do not "
                                    "set them", param="kv_transfer_params")
        model = body.get("model")
        if not isinstance(model, str):
            raise GatewayError(400, "`model` is required: a backend, an alias or route:<policy>", param="model")
        try:
            route = P.parse_route(model, names, config.aliases)
        except P.RouteError as e:
            known = model in config.aliases or model.startswith("route:")
            raise GatewayError(400 if known else 404, str(e), param="model",
                               code="invalid_route" if known else "model_not_found") from None
        if route.policy != "backend":
            _pair(config)
        stream = bool(body.get("stream"))
        cc = request.headers.get("cache-control", "").lower()

        key = None
        if cache is not None:
            if cache.cacheable(body) and "no-store" not in cc:
                reach = [(b.name, b.version) for b in _reachable(config, route)]
                route_id = aliases_resolved(model)
                extra = classifier.id if route.policy == "learned" and classifier else ""
                # the tenant is part of the key: a hit must not tell one tenant what another asked
                key = await asyncio.to_thread(cache_key, kind, route_id, reach, body, f"{extra}|tenant:{tenant}")
                if "no-cache" in cc:
                    cache.stats["bypass"] += 1
                else:
                    outcome, entry = await cache.lookup(key)
                    if entry is None and cache.semantic is not None:
                        found = cache.semantic.lookup(_semantic_group(kind, route_id, reach, body, tenant), P.conversation_text(body))
                        if found is not None:
                            outcome, entry = (await cache.lookup(found[0]))
                            outcome = "semantic_hit" if entry is not None else "miss"
                    cache.stats[outcome] += 1
                    if entry is not None:
                        if outcome == "stale":
                            cache.refresh(key, lambda: produce_entry(kind, route, body))
                        latency.labels("hit").observe(time.perf_counter() - started)
                        headers = dict(entry.headers, **{"x-sieve-cache": outcome})
                        return _deliver(entry.response, kind, body, stream, headers)
            else:
                cache.stats["bypass"] += 1

        if route.policy == "cascade":
            decision, answer, probe = await cascade(route, kind, body)
            sent = body
            if answer is None and probe is not None:  # escalated: the strong answer, or the weak one if the strong cannot
                try:
                    answer = await call(decision.backend, kind, body) if not stream else None
                except BackendDown as e:
                    log.warning("%s; the cascade keeps the weak answer", e)
                    decision = Decision(config.backends[config.weak], "cascade", decision.score,
                                        f"fallback: {decision.backend.name} unavailable")
                    answer = probe
            if answer is not None:
                await store(key, tenant, kind, route, body, answer, decision)
                requests_total.labels("cascade", decision.backend.name).inc()
                latency.labels("miss").observe(time.perf_counter() - started)
                return _deliver(answer, kind, body, stream, dict(decision.headers(), **_cache_header(key)))
        else:
            decision, sent = await decide(route, body)
        issued = None
        if decision.backend.prefill:
            sent, issued = await prefill_first(decision.backend, kind, sent)
        try:
            return await answer_from(decision, route, kind, key, tenant, body, sent, stream, started)
        except (GatewayError, BackendDown):
            await release_exported(decision.backend, issued)
            raise

    async def answer_from(decision: Decision, route: P.Route, kind: str, key: str | None, tenant: str, body: dict, sent: dict,
                          stream: bool, started: float) -> Response:
        if stream:
            (r, release), decision = await with_fallback(decision, route, lambda b: open_stream(b, kind, sent))
            requests_total.labels(decision.policy, decision.backend.name).inc()
            latency.labels("miss").observe(time.perf_counter() - started)
            return StreamingResponse(proxy_stream(r, release, kind, decision, key, tenant, route, body), media_type="text/event-stream",
                                     headers=dict(decision.headers(), **_cache_header(key)))
        answer, decision = await with_fallback(decision, route, lambda b: call(b, kind, sent))
        requests_total.labels(decision.policy, decision.backend.name).inc()
        await store(key, tenant, kind, route, body, answer, decision)
        latency.labels("miss").observe(time.perf_counter() - started)
        return JSONResponse(answer, headers=dict(decision.headers(), **_cache_header(key)))

    def aliases_resolved(model: str) -> str:
        return config.aliases.get(model, model)

    async def with_fallback(decision: Decision, route: P.Route, fn):
        try:
            return await fn(decision.backend), decision
        except BackendDown as e:
            alt = other(decision.backend) if route.policy != "backend" else None
            if alt is None:
                raise GatewayError(502, str(e), "upstream_error", code="backend_unavailable") from None
            log.warning("%s; answering from %s", e, alt.name)
            fallback = Decision(alt, decision.policy, decision.score, f"fallback: {decision.backend.name} unavailable")
            try:
                return await fn(alt), fallback
            except BackendDown as e2:
                raise GatewayError(502, f"{e}; {e2}", "upstream_error", code="backend_unavailable") from None

    async def produce_entry(kind: str, route: P.Route, body: dict) -> Entry | None:
        """A fresh answer for a stale entry (stale-while-revalidate)."""
        if route.policy == "cascade":
            decision, answer, _ = await cascade(route, kind, body)
            if answer is None:
                answer = await call(decision.backend, kind, body)
        else:
            decision, sent = await decide(route, body)
            answer, decision = await with_fallback(decision, route, lambda b: call(b, kind, sent))
        return Entry(answer, decision.headers(), cache.clock())

    async def store(key: str | None, tenant: str, kind: str, route: P.Route, body: dict, answer: dict, decision: Decision) -> None:
        if key is None or cache is None or not _complete(answer):
            return
        await cache.put(key, Entry(answer, decision.headers(), cache.clock()))
        if cache.semantic is not None:
            reach = [(b.name, b.version) for b in _reachable(config, route)]
            cache.semantic.add(_semantic_group(kind, aliases_resolved(body["model"]), reach, body, tenant), P.conversation_text(body), key)

    async def proxy_stream(r: httpx.Response, release, kind: str, decision: Decision, key: str | None, tenant: str, route: P.Route,
                           body: dict) -> AsyncIterator[str]:
        chunks: list[dict] = []
        try:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data.strip() == "[DONE]":
                    yield "data: [DONE]\n\n"
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    continue
                if isinstance(chunk, dict) and "model" in chunk:
                    chunk["model"] = decision.backend.name
                chunks.append(chunk)
                yield "data: " + json.dumps(chunk) + "\n\n"
            else:  # the backend closed the stream without [DONE]: the client is told, not left with a truncated answer
                raise httpx.RemoteProtocolError("the backend closed the stream before [DONE]")
        except httpx.HTTPError as e:
            upstream_errors.labels(decision.backend.name).inc()
            yield "data: " + json.dumps(error_body(f"backend {decision.backend.name}: {e}", "upstream_error", code="backend_stream_failed")) + "\n\n"
            yield "data: [DONE]\n\n"
            return
        finally:
            release()
            await r.aclose()
        answer = assemble(chunks, kind) if key is not None else None
        if answer is not None:
            await store(key, tenant, kind, route, body, answer, decision)

    for path, kind in ENDPOINTS.items():
        app.add_api_route(path, _endpoint(handle, kind), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        tenant_of(request)
        data = [{"id": b.name, "object": "model", "owned_by": "sieve-router", "version": b.version,
                 "cost_per_token": b.cost_per_token, "replicas": len(b.urls)} for b in backends.values()]
        data += [{"id": alias, "object": "model", "owned_by": "sieve-router", "route": target} for alias, target in config.aliases.items()]
        if config.weak and config.strong:
            data += [{"id": f"route:{p}", "object": "model", "owned_by": "sieve-router"} for p in ("learned", "cascade", "budget")]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health_check(request: Request):
        """Open to anyone: up or not. The backends' URLs only to a client with a key (or on an open gateway)."""
        status = 200 if any(health.values()) else 503
        answer = {"status": "ok" if status == 200 else "unavailable"}
        if not keys.enabled or keys.tenant(request.headers.get("authorization")) is not None:
            answer["backends"] = {name: {url: health[url] for url in b.urls} for name, b in backends.items()}
        return JSONResponse(answer, status_code=status)

    @app.get("/metrics")
    async def metrics(request: Request):
        tenant_of(request)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _endpoint(handle, kind: str):
    async def endpoint(request: Request):
        return await handle(kind, request)
    return endpoint


def _root(url: str) -> str:
    """A backend's server root, from its base URL (http://host:port/v1 -> http://host:port)."""
    return url[: -len("/v1")] if url.endswith("/v1") else url


_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "seed", "top_logprobs")


def check_body(kind: str, body: dict) -> None:
    """The fields the gateway itself reads (to route, cache, cascade, budget, balance) have the types OpenAI gives them;
    any other is a 400 naming the field here, not a crash further in. The backend checks the rest."""
    def bad(field: str, what: str):
        raise GatewayError(400, f"`{field}` must be {what}", param=field)

    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            bad("messages", "a non-empty list of message objects")
        for i, m in enumerate(messages):
            content = m.get("content")
            if not (content is None or isinstance(content, str) or (isinstance(content, list) and all(isinstance(p, dict) for p in content))):
                bad(f"messages.{i}.content", "a string or a list of content parts")
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(x, (str, int, list)) for x in prompt))):
            bad("prompt", "a string, a list of strings or token ids")
    for field in _INT_FIELDS:
        v = body.get(field)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            bad(field, "an integer")
    if body.get("logprobs") is not None and not isinstance(body["logprobs"], (bool, int)):
        bad("logprobs", "a boolean (chat) or an integer (completions)")
    for field in ("temperature", "top_p"):
        v = body.get(field)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            bad(field, "a number")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        bad("stream", "a boolean")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        bad("stream_options", "an object")
    if body.get("reasoning_effort") is not None and not isinstance(body["reasoning_effort"], str):
        bad("reasoning_effort", "a string")


def _path(kind: str) -> str:
    return "chat/completions" if kind == "chat" else "completions"


def _auth(b: Backend) -> dict:
    return {"Authorization": f"Bearer {b.api_key}"} if b.api_key else {}


def _pair(config: RouterConfig) -> tuple[Backend, Backend]:
    if config.weak is None or config.strong is None:
        raise GatewayError(400, "routing policies need a weak and a strong backend; this router has none configured "
                                "(`weak` and `strong` in its config)", param="model", code="route_unavailable")
    return config.pair()


def _reachable(config: RouterConfig, route: P.Route) -> list[Backend]:
    if route.policy == "backend":
        return [config.backends[route.backend]]
    if route.policy == "budget" and route.backend:
        return [config.backends[route.backend]]
    return list(_pair(config))


def _semantic_group(kind: str, route_id: str, reach, body: dict, tenant: str) -> str:
    rest = {k: v for k, v in body.items() if k not in ("messages", "prompt", "model", "stream", "stream_options")}
    return cache_key(kind, route_id, reach, rest, f"tenant:{tenant}")


def _cache_header(key: str | None) -> dict:
    return {"x-sieve-cache": "miss"} if key is not None else {}


def _complete(answer: dict) -> bool:
    """Only whole answers are cached: every choice finished by stop or length."""
    choices = answer.get("choices") or []
    return bool(choices) and all(c.get("finish_reason") in ("stop", "length", "tool_calls") for c in choices)


def _strip_logprobs(answer: dict, kind: str, body: dict) -> None:
    """The cascade asked the weak backend for logprobs; the client gets only what it asked for."""
    for choice in answer.get("choices") or []:
        lp = choice.get("logprobs")
        if lp is None:
            continue
        if kind == "chat":
            if not body.get("logprobs"):
                choice["logprobs"] = None
            else:
                k = int(body.get("top_logprobs") or 0)
                for row in lp.get("content") or []:
                    row["top_logprobs"] = (row.get("top_logprobs") or [])[:k]
        else:
            k = body.get("logprobs")
            if k is None:
                choice["logprobs"] = None
            elif lp.get("top_logprobs"):
                lp["top_logprobs"] = [dict(sorted(d.items(), key=lambda kv: -kv[1])[:k]) if d else d for d in lp["top_logprobs"]]


def _deliver(answer: dict, kind: str, body: dict, stream: bool, headers: dict) -> Response:
    if not stream:
        return JSONResponse(answer, headers=headers)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(replay(answer, kind, include_usage), media_type="text/event-stream", headers=headers)
