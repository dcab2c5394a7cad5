"""The gateway's calls to its backends: pick a replica (the balancer), send, and on a replica that cannot be reached
(or answers 503) mark it down and try the next; one call, one stream, the prefill leg of a disaggregated request and
the release of its blocks; the background health check."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx

from sieve.router.balance import Balancer, prompt_blocks
from sieve.router.config import Backend, RouterConfig
from sieve.router.metrics import GatewayMetrics
from sieve.server.errors import APIError, error_body

log = logging.getLogger("sieve.router")


class ReplicaDown(Exception):
    """One replica could not answer: the next is tried."""


class BackendDown(Exception):
    def __init__(self, backend: Backend, why: str):
        super().__init__(f"backend {backend.name} is unavailable: {why}")
        self.backend = backend


def api_path(kind: str) -> str:
    return "chat/completions" if kind == "chat" else "completions"


def auth_headers(b: Backend) -> dict:
    return {"Authorization": f"Bearer {b.api_key}"} if b.api_key else {}


def server_root(url: str) -> str:
    """A backend's server root, from its base URL (http://host:port/v1 -> http://host:port)."""
    return url[: -len("/v1")] if url.endswith("/v1") else url


class Upstream:
    """The backends, their replicas' health and balancers, and one HTTP client (`open` in the app's lifespan)."""

    def __init__(self, config: RouterConfig, metrics: GatewayMetrics, health: dict[str, bool], balancers: dict[str, Balancer]):
        self.config, self.metrics, self.health, self.balancers = config, metrics, health, balancers
        self.client: httpx.AsyncClient | None = None
        self.prefill_turn = 0

    def open(self) -> None:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.config.timeout, connect=5.0))

    async def close(self) -> None:
        await self.client.aclose()

    async def check_health(self) -> None:
        """Forever: every replica's own /health (/v1/models answers 200 while a server's engine is stalled or dead)."""
        while True:
            for b in self.config.backends.values():
                for url in (*b.urls, *b.prefill):
                    try:
                        r = await self.client.get(server_root(url) + "/health", headers=auth_headers(b),
                                                  timeout=min(5.0, self.config.health_interval))
                        up = r.status_code == 200
                    except httpx.HTTPError:
                        up = False
                    if up != self.health[url]:
                        log.warning("backend %s replica %s is %s", b.name, url, "up again" if up else "down")
                    self.health[url] = up
            await asyncio.sleep(self.config.health_interval)

    async def on_replicas(self, backend: Backend, body: dict, send):
        """`send(url)` on the replica the balancer picks; a replica that cannot be reached (or answers 5xx) is
        marked down and the next one is tried, so a dead replica costs its requests nothing but a retry."""
        bal = self.balancers[backend.name]
        blocks = await asyncio.to_thread(prompt_blocks, body) if bal.policy == "cache_aware" else []  # off the event loop
        tried: list[str] = []
        errors = []
        while len(tried) < len(backend.urls):
            rest = [u for u in backend.urls if u not in tried]
            url, reason = bal.pick(blocks, [u for u in rest if self.health[u]] or rest)
            tried.append(url)
            bal.inflight[url] += 1
            try:
                result = await send(url)
            except ReplicaDown as e:
                bal.inflight[url] -= 1
                self.health[url] = False
                self.metrics.upstream_errors.labels(backend.name).inc()
                errors.append(f"{url}: {e}")
                continue
            except BaseException:
                bal.inflight[url] -= 1
                raise
            self.metrics.picks.labels(backend.name, url, reason).inc()
            bal.sent(url, blocks)
            return url, result
        raise BackendDown(backend, "; ".join(errors))

    async def call(self, backend: Backend, kind: str, body: dict) -> dict:
        """One non-streamed call; BackendDown when no replica answers; APIError (the backend's, passed through) on 4xx."""
        body = dict(body, model=backend.upstream_model, stream=False)
        body.pop("stream_options", None)

        async def send(url: str) -> httpx.Response:
            try:
                r = await self.client.post(f"{url}/{api_path(kind)}", json=body, headers=auth_headers(backend))
            except httpx.TransportError as e:
                raise ReplicaDown(f"{type(e).__name__}: {e}") from e
            if r.status_code == 503:  # unavailable: another replica may answer. A 500 (a step that failed) is not
                raise ReplicaDown(f"HTTP {r.status_code}: {r.text[:200]}")  # retried: it would fail its batch there too
            return r

        url, r = await self.on_replicas(backend, body, send)
        self.balancers[backend.name].inflight[url] -= 1
        try:
            payload = r.json()
        except ValueError:
            self.metrics.upstream_errors.labels(backend.name).inc()
            raise BackendDown(backend, f"{url}: the response is not JSON") from None
        if r.status_code != 200:
            if r.status_code >= 500:
                self.metrics.upstream_errors.labels(backend.name).inc()
            raise APIError(r.status_code, "", body=payload if isinstance(payload, dict) and "error" in payload else
                           error_body(str(payload), "upstream_error"))
        payload["model"] = backend.name
        return payload

    async def prefill_first(self, backend: Backend, kind: str, body: dict) -> tuple[dict, tuple[str, dict] | None]:
        """Prefill/decode disaggregation (vLLM's proxy contract): the prompt runs on a prefill server with max_tokens
        1 and kv_transfer_params {"do_remote_decode": true}; its answer's kv_transfer_params go with the request to the
        decode server. No prefill server answering is no error: the decode server then computes the prompt itself.
        Returns the body for the decode server, and (prefill server, its params) when blocks were exported."""
        started = time.perf_counter()
        leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens", "n")}
        leg.update(model=backend.upstream_model, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        urls = list(backend.prefill)
        first = self.prefill_turn % len(urls)
        self.prefill_turn += 1
        order = urls[first:] + urls[:first]
        for url in [u for u in order if self.health[u]] + [u for u in order if not self.health[u]]:
            try:
                r = await self.client.post(f"{url}/{api_path(kind)}", json=leg, headers=auth_headers(backend))
                params = r.json().get("kv_transfer_params") if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError) as e:
                self.health[url] = False
                self.metrics.upstream_errors.labels(backend.name).inc()
                log.warning("prefill server %s: %s", url, e)
                continue
            if r.status_code >= 500:
                self.health[url] = False
                self.metrics.upstream_errors.labels(backend.name).inc()
                continue
            if r.status_code != 200:  # the request itself is bad: the decode server will say why
                break
            if isinstance(params, dict):
                self.metrics.pd.labels(backend.name, "transferred").inc()
                self.metrics.pd_seconds.observe(time.perf_counter() - started)
                return dict(body, kv_transfer_params=params), (url, params)
        self.metrics.pd.labels(backend.name, "prefill_failed").inc()
        return body, None

    async def release_exported(self, backend: Backend, issued: tuple[str, dict] | None) -> None:
        """The decode leg refused or failed: the prefill server gives its exported blocks back now, not at lease end."""
        if issued is None:
            return
        url, params = issued
        try:
            r = await self.client.post(f"{url}/kv_transfer/release", json={"kv_transfer_params": params}, headers=auth_headers(backend))
            if r.status_code != 200:
                log.warning("prefill server %s did not release its blocks: HTTP %d %s", url, r.status_code, r.text[:200])
        except httpx.HTTPError as e:
            log.warning("prefill server %s did not release its blocks: %s", url, e)

    async def open_stream(self, backend: Backend, kind: str, body: dict) -> tuple[httpx.Response, callable]:
        """The upstream stream, open and 200, and the function that releases its replica when it ends."""
        body = dict(body, model=backend.upstream_model, stream=True)

        async def send(url: str) -> httpx.Response:
            req = self.client.build_request("POST", f"{url}/{api_path(kind)}", json=body, headers=auth_headers(backend))
            try:
                r = await self.client.send(req, stream=True)
            except httpx.TransportError as e:
                raise ReplicaDown(f"{type(e).__name__}: {e}") from e
            if r.status_code == 503:
                text = (await r.aread()).decode(errors="replace")
                await r.aclose()
                raise ReplicaDown(f"HTTP {r.status_code}: {text[:200]}")
            return r

        url, r = await self.on_replicas(backend, body, send)
        bal = self.balancers[backend.name]
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
            raise APIError(r.status_code, "", body=payload)
        return r, release
