"""The gateway's Prometheus metrics: requests by policy and backend, cascade outcomes, upstream errors, replica picks,
budget tokens, prefill/decode legs, latency, and collectors over the response cache and the replicas' health."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sieve.router.balance import Balancer
from sieve.router.cache import ResponseCache
from sieve.router.config import Backend


class CacheCollector:
    def __init__(self, cache: ResponseCache):
        self.cache = cache

    def collect(self):
        c = CounterMetricFamily("sieve:router_cache_events", "Response cache lookups by outcome, and store errors", labels=["event"])
        for event, n in self.cache.stats.items():
            c.add_metric([event], n)
        yield c


class BackendCollector:
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


class GatewayMetrics:
    def __init__(self, backends: dict[str, Backend], health: dict[str, bool], balancers: dict[str, Balancer],
                 cache: ResponseCache | None):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("sieve:router_requests", "Requests answered, by policy and the backend that answered",
                                ["policy", "backend"], registry=registry)
        self.cascade = Counter("sieve:router_cascade_decisions", "Cascade outcomes", ["decision"], registry=registry)
        self.upstream_errors = Counter("sieve:router_upstream_errors", "Backend calls that failed (unreachable or 5xx)", ["backend"],
                                       registry=registry)
        self.picks = Counter("sieve:router_replica_picks", "Replica choices, by reason (prefix: affinity; load: least loaded; "
                             "round_robin; only: one candidate)", ["backend", "replica", "reason"], registry=registry)
        self.budget_tokens = Counter("sieve:router_budget_tokens", "max_tokens granted by the budget policy", registry=registry)
        self.pd = Counter("sieve:router_pd_requests", "Disaggregated requests: prefilled remotely (transferred), or decoded "
                          "from scratch because no prefill server answered (prefill_failed)", ["backend", "outcome"], registry=registry)
        self.pd_seconds = Histogram("sieve:router_pd_prefill_seconds", "Time of the prefill leg of a disaggregated request",
                                    registry=registry, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.latency = Histogram("sieve:router_request_latency_seconds", "Gateway latency (to the response, or to the first byte "
                                 "of a stream)", ["cache"], registry=registry,
                                 buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        if cache is not None:
            registry.register(CacheCollector(cache))
        registry.register(BackendCollector(backends, health, balancers))

    def render(self) -> bytes:
        return generate_latest(self.registry)
