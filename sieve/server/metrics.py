"""Prometheus metrics, named after vLLM's (`vllm:` -> `sieve:`) so its dashboards map over.

Timestamps come from the engine (monotonic, per request); the arithmetic happens here, at the edge.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sieve.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.registry = r = CollectorRegistry()
        label = {"model_name": model_name}
        self.requests = Counter("sieve:request_success", "Finished requests by finish reason", ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("sieve:prompt_tokens", "Prompt tokens processed", ["model_name"], registry=r).labels(**label)
        self.generation_tokens = Counter("sieve:generation_tokens", "Tokens generated", ["model_name"], registry=r).labels(**label)
        self.ttft = Histogram("sieve:time_to_first_token_seconds", "Time to first token", ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**label)
        self.tpot = Histogram("sieve:time_per_output_token_seconds", "Time per output token after the first", ["model_name"], buckets=_TPOT_BUCKETS, registry=r).labels(**label)
        self.e2e = Histogram("sieve:e2e_request_latency_seconds", "End-to-end request latency", ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**label)
        # vLLM's phases of a request: waiting (arrival to first scheduled), prefill (to its first token), decode (to
        # its end), inference (prefill and decode)
        self.phases = {phase: Histogram(f"sieve:request_{phase}_time_seconds", what, ["model_name"], buckets=_LATENCY_BUCKETS,
                                        registry=r).labels(**label)
                       for phase, what in (("queue", "Time from arrival to first scheduled"),
                                           ("prefill", "Time from first scheduled to the first token"),
                                           ("decode", "Time from the first token to the last"),
                                           ("inference", "Time from first scheduled to the last token"))}
        self.rejected = Counter("sieve:request_rejected", "Requests refused with 429 (queue full, or --slo-reject)", ["model_name"], registry=r).labels(**label)
        limits = Counter("sieve:limit_refusals", "Requests refused (400) and streams cut by a server limit, by limit",
                         ["model_name", "limit"], registry=r)
        self.limit_refused = lambda limit: limits.labels(model_name=model_name, limit=limit).inc()
        r.register(EngineCollector(engine, model_name))
        self.model_name = model_name
        # --tenants: the same per tenant (its name, or `other`: the label's values are bounded by the file)
        tenant = ["model_name", "tenant"]
        self.tenant_requests = Counter("sieve:tenant_request_success", "Finished requests by tenant and finish reason",
                                       tenant + ["finished_reason"], registry=r)
        self.tenant_prompt_tokens = Counter("sieve:tenant_prompt_tokens", "Prompt tokens processed, by tenant", tenant, registry=r)
        self.tenant_generation_tokens = Counter("sieve:tenant_generation_tokens", "Tokens generated, by tenant", tenant, registry=r)
        self.tenant_ttft = Histogram("sieve:tenant_time_to_first_token_seconds", "Time to first token, by tenant", tenant,
                                     buckets=_LATENCY_BUCKETS, registry=r)
        refusals = Counter("sieve:tenant_limit_refusals", "Requests refused (429) by a tenant's limit", tenant + ["limit"],
                           registry=r)
        self.tenant_refused = lambda name, limit: refusals.labels(model_name=model_name, tenant=name, limit=limit).inc()
        # --batch-dir: the Batch API's requests, by the tenant whose batch they are, apart from interactive ones
        self.batch_requests = Counter("sieve:batch_request_success", "Finished Batch API requests by tenant and finish reason",
                                      tenant + ["finished_reason"], registry=r)
        self.batch_prompt_tokens = Counter("sieve:batch_prompt_tokens", "Prompt tokens of Batch API requests, by tenant",
                                           tenant, registry=r)
        self.batch_generation_tokens = Counter("sieve:batch_generation_tokens", "Tokens generated for Batch API requests, "
                                               "by tenant", tenant, registry=r)

    def record_finished(self, out: RequestOutput, tenant: str | None = None) -> None:
        m = out.metrics
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        labels = {"model_name": self.model_name, "tenant": tenant}
        if tenant is not None:
            self.tenant_prompt_tokens.labels(**labels).inc(len(out.prompt_token_ids))
        for c in out.outputs:
            self.requests.labels(model_name=self.model_name, finished_reason=c.finish_reason or "abort").inc()
            self.generation_tokens.inc(len(c.token_ids))
            if tenant is not None:
                self.tenant_requests.labels(**labels, finished_reason=c.finish_reason or "abort").inc()
                self.tenant_generation_tokens.labels(**labels).inc(len(c.token_ids))
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.phases["queue"].observe(m.first_scheduled_time - m.arrival_time)
            self.phases["inference"].observe(m.finished_time - m.first_scheduled_time)
            if m.first_token_time is not None:
                self.phases["prefill"].observe(m.first_token_time - m.first_scheduled_time)
                self.phases["decode"].observe(m.finished_time - m.first_token_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if tenant is not None:
                self.tenant_ttft.labels(**labels).observe(m.first_token_time - m.arrival_time)
            n = max(len(c.token_ids) for c in out.outputs)
            if n > 1:
                self.tpot.observe((m.finished_time - m.first_token_time) / (n - 1))

    def record_batch_finished(self, out: RequestOutput, tenant: str) -> None:
        """A Batch API request: in the engine's totals and the batch counters, by the batch's tenant, but not in the
        latency histograms or the tenant_* counters, which describe interactive service."""
        labels = {"model_name": self.model_name, "tenant": tenant}
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.batch_prompt_tokens.labels(**labels).inc(len(out.prompt_token_ids))
        for c in out.outputs:
            self.requests.labels(model_name=self.model_name, finished_reason=c.finish_reason or "abort").inc()
            self.generation_tokens.inc(len(c.token_ids))
            self.batch_requests.labels(**labels, finished_reason=c.finish_reason or "abort").inc()
            self.batch_generation_tokens.labels(**labels).inc(len(c.token_ids))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector:
    """Everything the engine counts, read from one `engine.stats()` snapshot per scrape: queue gauges, KV usage, the
    prefix cache (tokens, as vLLM counts them), structured outputs, speculative decoding and KV transfer (vLLM's names)."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s, label = self.engine.stats(), [self.model_name]
        yield from _family(GaugeMetricFamily, "sieve:num_requests_running", "Sequences running", label, s.num_running)
        yield from _family(GaugeMetricFamily, "sieve:num_requests_waiting", "Requests waiting", label, s.num_waiting)
        yield from _family(GaugeMetricFamily, "sieve:kv_cache_usage_perc", "KV-cache usage, 0 to 1", label, s.kv_cache_usage)
        yield from _family(CounterMetricFamily, "sieve:prefix_cache_queries", "Tokens looked up in the prefix cache", label,
                           s.prefix_cache_queried_tokens)
        yield from _family(CounterMetricFamily, "sieve:prefix_cache_hits", "Tokens found in the prefix cache", label,
                           s.prefix_cache_hit_tokens)
        yield from _family(GaugeMetricFamily, "sieve:prefix_cache_hit_rate", "Prefix-cache hits / queries since start, 0 to 1", label,
                           s.prefix_cache_hit_rate)
        yield from _family(GaugeMetricFamily, "sieve:prefix_cache_blocks", "KV blocks held by the prefix cache", label,
                           s.prefix_cache_blocks)
        yield from self.structured(s.structured)
        if s.spec_decode is not None:
            yield from self.spec_decode(s.spec_decode)
        if s.kv_transfer is not None:
            yield from self.kv_transfer(s.kv_transfer)
        if s.kv_tiers is not None:
            yield from self.kv_tiers(s.kv_tiers)
        if s.lora is not None:
            yield from self.lora(s.lora)
        c = s.kv_compression
        yield from _counters("sieve:kv_compression_", self.model_name, (
            ("requests", "Requests whose prompt KV a press compressed", c.requests),
            ("prompt_tokens", "Prompt tokens of those requests", c.prompt_tokens),
            ("dropped_tokens", "Prompt positions a press dropped (each frees its slot in every layer)", c.dropped_tokens),
            ("skipped", "Presses skipped: no room for the compacted copy and the prompt's blocks shared", c.skipped),
            ("seconds", "Seconds spent choosing and compacting kept positions", c.seconds),
        ))

    def lora(self, s):
        """vLLM's lora_requests_info (the adapters of running and of waiting requests, and max_lora, as labels; the
        value the time of the scrape), and the adapters registered, in memory and read since start."""
        family = GaugeMetricFamily("sieve:lora_requests_info", "Running stats on LoRA requests",
                                   labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
        family.add_metric([",".join(s.running), str(s.max_loras), ",".join(s.waiting)], time.time())
        yield family
        yield from _family(GaugeMetricFamily, "sieve:lora_adapters_registered", "LoRA adapters that requests may name",
                           [self.model_name], s.registered)
        yield from _family(GaugeMetricFamily, "sieve:lora_adapters_in_memory", "LoRA adapters held in memory (up to "
                           "--max-cpu-loras; the others are read again when asked for)", [self.model_name], s.in_memory)
        yield from _counters("sieve:lora_", self.model_name, (
            ("adapter_loads", "LoRA adapters read from disk (a load, or one dropped from memory asked for again)", s.loads),))

    def structured(self, st):
        """Time spent on token masks (computing and applying them), per step and per row, and grammar compilation."""
        yield from _counters("sieve:structured_output_", self.model_name, (
            ("mask_seconds", "Seconds spent computing and applying grammar token masks", st.mask_seconds),
            ("mask_steps", "Steps that masked at least one row", st.num_masked_steps),
            ("mask_rows", "Rows (sampled positions) masked", st.num_masked_rows),
            ("grammars_compiled", "Grammars compiled (cache misses)", st.grammars_compiled),
            ("grammar_cache_hits", "Requests whose grammar was already compiled", st.grammar_cache_hits),
            ("compile_seconds", "Seconds spent compiling grammars", st.compile_seconds),
        ))

    def spec_decode(self, s):
        """Drafts verified, tokens drafted, tokens accepted, and accepted tokens per draft position."""
        yield from _counters("sieve:spec_decode_", self.model_name, (
            ("num_drafts", "Drafts verified", s.num_drafts),
            ("num_draft_tokens", "Tokens drafted", s.num_draft_tokens),
            ("num_accepted_tokens", "Drafted tokens accepted", s.num_accepted_tokens),
        ))
        per_pos = CounterMetricFamily("sieve:spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted, per draft position",
                                      labels=["model_name", "position"])
        for pos, value in enumerate(s.accepted_per_pos):
            per_pos.add_metric([self.model_name, str(pos)], value)
        yield per_pos

    def kv_transfer(self, s):
        """KV bytes, blocks and seconds moved, by direction (save: a prefill server's blocks for a decode server; load: a
        decode server's from a prefill server), and transfers that fell back to computing locally, by reason."""
        for name, doc, counts in (("bytes", "KV bytes transferred", s.bytes), ("blocks", "KV blocks transferred", s.blocks),
                                  ("seconds", "Seconds spent transferring KV", s.seconds)):
            family = CounterMetricFamily(f"sieve:kv_transfer_{name}", doc, labels=["model_name", "direction"])
            for direction in ("save", "load"):
                family.add_metric([self.model_name, direction], counts.get(direction, 0))
            yield family
        for name, doc, counts in (("fallbacks", "Transfers cut short (the rest computed locally), by reason", s.fallbacks),
                                  ("refused", "Remote-prefill params and exports refused, by reason", s.refused)):
            family = CounterMetricFamily(f"sieve:kv_transfer_{name}", doc, labels=["model_name", "reason"])
            for reason, n in sorted(counts.items()):
                family.add_metric([self.model_name, reason], n)
            yield family


    def kv_tiers(self, s):
        """The KV tiers below the pool (sieve/kv_tiers): per tier, blocks loaded, held, evicted, failed writes; per tier
        and direction, bytes and seconds; blocks failing their check; blocks left to recompute, by reason."""
        m = self.model_name
        for name, doc, counts, kind in (("hits", "KV blocks loaded from a tier into the pool", s.hits, CounterMetricFamily),
                                        ("resumed_hits", "KV blocks loaded from a tier for a preempted sequence resuming "
                                         "(of the hits): preemption without recompute", s.resumed, CounterMetricFamily),
                                        ("blocks", "KV blocks a tier holds (Redis: those this server wrote or read there)",
                                         s.blocks_held, GaugeMetricFamily),
                                        ("evictions", "KV blocks a tier dropped for room", s.evictions, CounterMetricFamily),
                                        ("write_errors", "KV block writes a tier failed (a full disk, a dead store)",
                                         s.write_errors, CounterMetricFamily),
                                        ("read_errors", "KV tier reads that failed (a dead store): recomputed",
                                         s.read_errors, CounterMetricFamily)):
            family = kind(f"sieve:kv_tier_{name}", doc, labels=["model_name", "tier"])
            for tier in sorted(set(s.blocks_held) | set(counts)):
                family.add_metric([m, tier], counts.get(tier, 0))
            yield family
        for name, doc, counts in (("bytes", "KV bytes moved to and from a tier", s.bytes),
                                  ("seconds", "Seconds spent moving KV to and from a tier", s.seconds)):
            family = CounterMetricFamily(f"sieve:kv_tier_{name}", doc, labels=["model_name", "tier", "direction"])
            for tier in sorted(s.blocks_held):
                for direction in ("write", "read"):
                    family.add_metric([m, tier, direction], counts.get((tier, direction), 0))
            yield family
        yield from _counters("sieve:kv_tier_", m, (
            ("checksum_failures", "KV blocks that failed their check (MAC, layout, size): deleted and recomputed",
             s.checksum_failures),
            ("dropped_writes", "KV blocks not written because the writer's queue was full", s.dropped_writes)))
        family = GaugeMetricFamily("sieve:kv_tier_lossy", "1 where the KV tiers hold blocks lossily (--kv-tier-dtype), "
                                   "so that a loaded block is not the bytes the pool held", labels=["model_name", "dtype"])
        family.add_metric([m, s.dtype], 0 if s.dtype == "auto" else 1)
        yield family
        family = CounterMetricFamily("sieve:kv_tier_recomputed_blocks", "KV blocks a tier held or was asked for that were "
                                     "recomputed instead, by reason", labels=["model_name", "reason"])
        for reason, n in sorted(s.recomputed.items()):
            family.add_metric([m, reason], n)
        yield family


def _family(kind, name: str, doc: str, label: list[str], value):
    family = kind(name, doc, labels=["model_name"])
    family.add_metric(label, value)
    yield family


def _counters(prefix: str, model_name: str, rows):
    """Counter families read at scrape time: (name, help, value) rows under `prefix`, labelled by model."""
    for name, doc, value in rows:
        family = CounterMetricFamily(prefix + name, doc, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family
