"""One request through the gateway: parse and check it, look it up in the response cache, choose the backend
(a direct route, the learned router, a token budget or a cascade), run the prefill leg of a disaggregated backend,
answer (whole or streamed, falling back to the pair's other backend when one cannot answer), and cache the answer."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sieve.router import policy as P
from sieve.router.cache import Entry, ResponseCache, cache_key
from sieve.router.classifier import Classifier
from sieve.router.config import Backend, RouterConfig
from sieve.router.metrics import GatewayMetrics
from sieve.router.stream import assemble, replay
from sieve.router.upstream import BackendDown, Upstream
from sieve.server.auth import APIKeys
from sieve.server.errors import APIError, error_body

log = logging.getLogger("sieve.router")

INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "seed", "top_logprobs")


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


@dataclass
class Call:
    """One request as the gateway handles it."""

    kind: str
    body: dict
    route: P.Route
    tenant: str
    stream: bool
    started: float
    key: str | None = None  # its response cache key, when it may be cached


class Gateway:
    def __init__(self, config: RouterConfig, classifier: Classifier | None, cache: ResponseCache | None, keys: APIKeys,
                 upstream: Upstream, metrics: GatewayMetrics):
        self.config, self.classifier, self.cache, self.keys = config, classifier, cache, keys
        self.upstream, self.metrics = upstream, metrics

    def tenant_of(self, request: Request) -> str:
        """The client's tenant (its key's); every route but /health calls this. Open gateways have one tenant."""
        if not self.keys.enabled:
            return ""
        tenant = self.keys.tenant(request.headers.get("authorization"))
        if tenant is None:
            raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        return tenant

    # ---- one request ---------------------------------------------------------------------------
    async def handle(self, kind: str, request: Request) -> Response:
        call = await self.parse(kind, request)
        cached = await self.from_cache(call, request.headers.get("cache-control", "").lower())
        if cached is not None:
            return cached
        if call.route.policy == "cascade":
            decision, answer, probe = await self.cascade(call.route, kind, call.body)
            if answer is None and probe is not None:  # escalated: the strong answer, or the weak one if the strong cannot
                try:
                    answer = await self.upstream.call(decision.backend, kind, call.body) if not call.stream else None
                except BackendDown as e:
                    log.warning("%s; the cascade keeps the weak answer", e)
                    decision = Decision(self.config.backends[self.config.weak], "cascade", decision.score,
                                        f"fallback: {decision.backend.name} unavailable")
                    answer = probe
            if answer is not None:
                await self.store(call, answer, decision)
                self.metrics.requests.labels("cascade", decision.backend.name).inc()
                self.metrics.latency.labels("miss").observe(time.perf_counter() - call.started)
                return deliver(answer, kind, call.body, call.stream, dict(decision.headers(), **cache_header(call.key)))
            sent = call.body
        else:
            decision, sent = await self.decide(call.route, call.body)
        issued = None
        if decision.backend.prefill:
            sent, issued = await self.upstream.prefill_first(decision.backend, kind, sent)
        try:
            return await self.answer_from(decision, call, sent)
        except (APIError, BackendDown):
            await self.upstream.release_exported(decision.backend, issued)
            raise

    async def parse(self, kind: str, request: Request) -> Call:
        started = time.perf_counter()
        tenant = self.tenant_of(request)
        raw = await request.body()
        try:  # parsed and hashed off the event loop: a 16 MB body stalls no other client
            body = await asyncio.to_thread(json.loads, raw)
        except (ValueError, RecursionError):
            raise APIError(400, "the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        check_body(kind, body)
        if "kv_transfer_params" in body:
            raise APIError(400, "kv_transfer_params pass between the gateway's prefill and decode servers; clients do not "
                                "set them", param="kv_transfer_params")
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "`model` is required: a backend, an alias or route:<policy>", param="model")
        try:
            route = P.parse_route(model, set(self.config.backends), self.config.aliases)
        except P.RouteError as e:
            known = model in self.config.aliases or model.startswith("route:")
            raise APIError(400 if known else 404, str(e), param="model",
                           code="invalid_route" if known else "model_not_found") from None
        if route.policy != "backend":
            weak_strong(self.config)
        return Call(kind, body, route, tenant, bool(body.get("stream")), started)

    async def from_cache(self, call: Call, cc: str) -> Response | None:
        """The cached answer to `call`, if there is one (fresh, stale: refreshed behind it, or semantically near); sets
        `call.key` when its answer may be stored."""
        cache = self.cache
        if cache is None:
            return None
        if not cache.cacheable(call.body) or "no-store" in cc:
            cache.stats["bypass"] += 1
            return None
        reach = [(b.name, b.version) for b in reachable(self.config, call.route)]
        route_id = self.resolved(call.body["model"])
        extra = self.classifier.id if call.route.policy == "learned" and self.classifier else ""
        # the tenant is part of the key: a hit must not tell one tenant what another asked
        call.key = await asyncio.to_thread(cache_key, call.kind, route_id, reach, call.body, f"{extra}|tenant:{call.tenant}")
        if "no-cache" in cc:
            cache.stats["bypass"] += 1
            return None
        outcome, entry = await cache.lookup(call.key)
        if entry is None and cache.semantic is not None:
            found = cache.semantic.lookup(semantic_group(call.kind, route_id, reach, call.body, call.tenant),
                                          P.conversation_text(call.body))
            if found is not None:
                outcome, entry = await cache.lookup(found[0])
                outcome = "semantic_hit" if entry is not None else "miss"
        cache.stats[outcome] += 1
        if entry is None:
            return None
        if outcome == "stale":
            cache.refresh(call.key, lambda: self.produce_entry(call.kind, call.route, call.body))
        self.metrics.latency.labels("hit").observe(time.perf_counter() - call.started)
        return deliver(entry.response, call.kind, call.body, call.stream, dict(entry.headers, **{"x-sieve-cache": outcome}))

    async def answer_from(self, decision: Decision, call: Call, sent: dict) -> Response:
        kind = call.kind
        if call.stream:
            (r, release), decision = await self.with_fallback(decision, call.route, lambda b: self.upstream.open_stream(b, kind, sent))
            self.metrics.requests.labels(decision.policy, decision.backend.name).inc()
            self.metrics.latency.labels("miss").observe(time.perf_counter() - call.started)
            return StreamingResponse(self.proxy_stream(r, release, decision, call), media_type="text/event-stream",
                                     headers=dict(decision.headers(), **cache_header(call.key)))
        answer, decision = await self.with_fallback(decision, call.route, lambda b: self.upstream.call(b, kind, sent))
        self.metrics.requests.labels(decision.policy, decision.backend.name).inc()
        await self.store(call, answer, decision)
        self.metrics.latency.labels("miss").observe(time.perf_counter() - call.started)
        return JSONResponse(answer, headers=dict(decision.headers(), **cache_header(call.key)))

    # ---- policies ------------------------------------------------------------------------------
    def other(self, backend: Backend) -> Backend | None:
        if self.config.weak is None or self.config.strong is None:
            return None
        weak, strong = self.config.pair()
        return strong if backend.name == weak.name else weak if backend.name == strong.name else None

    async def decide(self, route: P.Route, body: dict) -> tuple[Decision, dict]:
        """The backend a non-cascade route picks, and the body to send it."""
        if route.policy == "backend":
            return Decision(self.config.backends[route.backend], "direct"), body
        weak, strong = weak_strong(self.config)
        if route.policy == "learned":
            classifier = self.classifier
            if classifier is None:
                raise APIError(400, "route:learned needs a classifier: start the router with --classifier FILE "
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
                raise APIError(400, str(e), param="reasoning_effort") from None
            new = P.apply_budget({k: v for k, v in body.items() if k != "reasoning_effort"}, budget, route.mode)
            self.metrics.budget_tokens.inc(budget)
            target = self.config.backends[route.backend] if route.backend else strong
            return Decision(target, "budget", float(budget), f"{route.mode} budget {budget} tokens"), new
        raise AssertionError(route.policy)

    async def cascade(self, route: P.Route, kind: str, body: dict) -> tuple[Decision, dict | None, dict | None]:
        """(decision, the weak answer when it stands, else None; the weak answer either way, when there is one):
        an escalated request goes to the strong backend, and falls back to the weak answer if it cannot."""
        weak, strong = weak_strong(self.config)
        if (body.get("n") or 1) != 1:
            raise APIError(400, "route:cascade decides on one answer: n must be 1", param="n")
        probe = dict(body)
        if kind == "chat":
            probe["logprobs"] = True
            probe["top_logprobs"] = max(int(body.get("top_logprobs") or 0), 20 if route.metric == "entropy" else 0)
        else:
            probe["logprobs"] = max(int(body.get("logprobs") or 0), 20 if route.metric == "entropy" else 1)
        try:
            answer = await self.upstream.call(weak, kind, probe)
        except BackendDown as e:
            log.warning("%s; the cascade escalates", e)
            self.metrics.cascade.labels("weak_unavailable").inc()
            return Decision(strong, "cascade", None, "fallback: weak backend unavailable"), None, None
        choice = (answer.get("choices") or [{}])[0]
        score = P.confidence(choice, route.metric)
        op = "<=" if route.metric == "entropy" else ">="
        strip_logprobs(answer, kind, body)
        if P.accept(score, route.metric, route.threshold):
            self.metrics.cascade.labels("accept").inc()
            return Decision(weak, "cascade", score, f"accepted: {route.metric} {op} {route.threshold:g}"), answer, answer
        self.metrics.cascade.labels("escalate").inc()
        return Decision(strong, "cascade", score, f"escalated: not {route.metric} {op} {route.threshold:g}"), None, answer

    def resolved(self, model: str) -> str:
        return self.config.aliases.get(model, model)

    async def with_fallback(self, decision: Decision, route: P.Route, fn):
        try:
            return await fn(decision.backend), decision
        except BackendDown as e:
            alt = self.other(decision.backend) if route.policy != "backend" else None
            if alt is None:
                raise APIError(502, str(e), "upstream_error", code="backend_unavailable") from None
            log.warning("%s; answering from %s", e, alt.name)
            fallback = Decision(alt, decision.policy, decision.score, f"fallback: {decision.backend.name} unavailable")
            try:
                return await fn(alt), fallback
            except BackendDown as e2:
                raise APIError(502, f"{e}; {e2}", "upstream_error", code="backend_unavailable") from None

    # ---- the response cache --------------------------------------------------------------------
    async def produce_entry(self, kind: str, route: P.Route, body: dict) -> Entry | None:
        """A fresh answer for a stale entry (stale-while-revalidate)."""
        if route.policy == "cascade":
            decision, answer, _ = await self.cascade(route, kind, body)
            if answer is None:
                answer = await self.upstream.call(decision.backend, kind, body)
        else:
            decision, sent = await self.decide(route, body)
            answer, decision = await self.with_fallback(decision, route, lambda b: self.upstream.call(b, kind, sent))
        return Entry(answer, decision.headers(), self.cache.clock())

    async def store(self, call: Call, answer: dict, decision: Decision) -> None:
        cache = self.cache
        if call.key is None or cache is None or not complete(answer):
            return
        await cache.put(call.key, Entry(answer, decision.headers(), cache.clock()))
        if cache.semantic is not None:
            reach = [(b.name, b.version) for b in reachable(self.config, call.route)]
            group = semantic_group(call.kind, self.resolved(call.body["model"]), reach, call.body, call.tenant)
            cache.semantic.add(group, P.conversation_text(call.body), call.key)

    async def proxy_stream(self, r: httpx.Response, release, decision: Decision, call: Call) -> AsyncIterator[str]:
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
            self.metrics.upstream_errors.labels(decision.backend.name).inc()
            yield "data: " + json.dumps(error_body(f"backend {decision.backend.name}: {e}", "upstream_error",
                                                   code="backend_stream_failed")) + "\n\n"
            yield "data: [DONE]\n\n"
            return
        finally:
            release()
            await r.aclose()
        answer = assemble(chunks, call.kind) if call.key is not None else None
        if answer is not None:
            await self.store(call, answer, decision)


def check_body(kind: str, body: dict) -> None:
    """The fields the gateway itself reads (to route, cache, cascade, budget, balance) have the types OpenAI gives them;
    any other is a 400 naming the field here, not a crash further in. The backend checks the rest."""
    def bad(field: str, what: str):
        raise APIError(400, f"`{field}` must be {what}", param=field)

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
    for field in INT_FIELDS:
        v = body.get(field)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            bad(field, "an integer")
    if body.get("logprobs") is not None and not isinstance(body["logprobs"], (bool, int)):
        bad("logprobs", "a boolean (chat) or an integer (completions)")
    for field in ("temperature", "top_p"):
        v = body.get(field)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            bad(field, "a number")
    for field, what, kinds in (("stream", "a boolean", bool), ("stream_options", "an object", dict), ("reasoning_effort", "a string", str)):
        if body.get(field) is not None and not isinstance(body[field], kinds):
            bad(field, what)


def weak_strong(config: RouterConfig) -> tuple[Backend, Backend]:
    if config.weak is None or config.strong is None:
        raise APIError(400, "routing policies need a weak and a strong backend; this router has none configured "
                            "(`weak` and `strong` in its config)", param="model", code="route_unavailable")
    return config.pair()


def reachable(config: RouterConfig, route: P.Route) -> list[Backend]:
    if route.policy == "backend":
        return [config.backends[route.backend]]
    if route.policy == "budget" and route.backend:
        return [config.backends[route.backend]]
    return list(weak_strong(config))


def semantic_group(kind: str, route_id: str, reach, body: dict, tenant: str) -> str:
    rest = {k: v for k, v in body.items() if k not in ("messages", "prompt", "model", "stream", "stream_options")}
    return cache_key(kind, route_id, reach, rest, f"tenant:{tenant}")


def cache_header(key: str | None) -> dict:
    return {"x-sieve-cache": "miss"} if key is not None else {}


def complete(answer: dict) -> bool:
    """Only whole answers are cached: every choice finished by stop or length."""
    choices = answer.get("choices") or []
    return bool(choices) and all(c.get("finish_reason") in ("stop", "length", "tool_calls") for c in choices)


def strip_logprobs(answer: dict, kind: str, body: dict) -> None:
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


def deliver(answer: dict, kind: str, body: dict, stream: bool, headers: dict) -> Response:
    if not stream:
        return JSONResponse(answer, headers=headers)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(replay(answer, kind, include_usage), media_type="text/event-stream", headers=headers)
