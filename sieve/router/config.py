"""The gateway's configuration: backends (any OpenAI-compatible endpoint), which is weak and which is strong,
aliases from model names to routes, and the response cache. From a JSON file, from flags, or both.

Every mistake is a `RouterConfigError` naming the field, raised before the gateway starts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse


class RouterConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Backend:
    name: str  # what clients may ask for, and what the response's `model` field says
    url: str  # base URL of the OpenAI API, e.g. http://127.0.0.1:8001/v1
    model: str | None = None  # the model id the backend serves (default: `name`)
    version: str = "1"  # part of every cache key: a new checkpoint behind the same name never reuses old answers
    cost_per_token: float = 0.0  # any currency per generated token; reported in the routing headers and the eval
    api_key: str | None = None
    replicas: tuple[str, ...] = ()  # more base URLs serving the same model (data parallel), balanced by the router
    # Prefill/decode disaggregation: base URLs of prefill servers (`sieve serve --role prefill`); with them, each
    # request's prompt runs there first (max_tokens 1) and `url`/`replicas` (--role decode) decode from its KV
    prefill: tuple[str, ...] = ()

    @property
    def upstream_model(self) -> str:
        return self.model or self.name

    @property
    def urls(self) -> list[str]:
        return [self.url, *self.replicas]


@dataclass(frozen=True)
class CacheConfig:
    backend: str = "memory"  # memory | redis | none
    redis_url: str = "redis://127.0.0.1:6379/0"
    ttl: float = 600.0  # seconds an answer is fresh
    stale_while_revalidate: float = 60.0  # seconds after ttl it is still served while one refresh runs behind it
    max_entries: int = 10_000  # the in-memory LRU
    cache_sampled: bool = False  # also cache requests that sample without a seed (they would never repeat otherwise)
    semantic_threshold: float | None = None  # cosine similarity for a near-duplicate hit; None: exact keys only


@dataclass(frozen=True)
class RouterConfig:
    backends: dict[str, Backend]
    weak: str | None = None
    strong: str | None = None
    aliases: dict[str, str] = field(default_factory=dict)  # model name -> "route:<policy>[:args]" or a backend name
    classifier: str | None = None  # file written by `sieve router train` (the `learned` policy)
    cache: CacheConfig = field(default_factory=CacheConfig)
    timeout: float = 600.0  # seconds one upstream request may take
    health_interval: float = 5.0
    balance: str = "cache_aware"  # how a backend's replicas share requests: cache_aware | round_robin | least_load
    balance_abs: int = 4  # cache_aware: in-flight requests a replica may run above the least loaded and keep its affinity
    api_keys: dict[str, str] = field(default_factory=dict)  # client key -> tenant; none: open (the CLI then binds loopback only)
    max_body_bytes: int = 16 << 20

    def pair(self) -> tuple[Backend, Backend]:
        if self.weak is None or self.strong is None:
            raise RouterConfigError("routing policies need a weak and a strong backend (`weak` and `strong` in the config, "
                                    "or --weak and --strong)")
        return self.backends[self.weak], self.backends[self.strong]


_BACKEND_FIELDS = {"name", "url", "model", "version", "cost_per_token", "api_key", "replicas", "prefill"}
_TOP_FIELDS = {"backends", "weak", "strong", "aliases", "classifier", "cache", "timeout", "health_interval", "balance", "balance_abs",
               "api_keys", "max_body_bytes"}
_CACHE_FIELDS = {"backend", "redis_url", "ttl", "stale_while_revalidate", "max_entries", "cache_sampled", "semantic_threshold"}


def _unknown(given: dict, known: set[str], where: str) -> None:
    extra = sorted(set(given) - known)
    if extra:
        raise RouterConfigError(f"{where}: unknown field(s) {', '.join(extra)} (known: {', '.join(sorted(known))})")


def _backend(d: dict, where: str) -> Backend:
    if not isinstance(d, dict):
        raise RouterConfigError(f"{where}: a backend is an object with at least `name` and `url`")
    _unknown(d, _BACKEND_FIELDS, where)
    for key in ("name", "url"):
        if not isinstance(d.get(key), str) or not d[key]:
            raise RouterConfigError(f"{where}: `{key}` is required (a string)")
    for key, types in (("model", str), ("api_key", str), ("version", (str, int))):
        if d.get(key) is not None and (not isinstance(d[key], types) or isinstance(d[key], bool)):
            raise RouterConfigError(f"{where}: `{key}` must be a string")
    replicas = d.get("replicas") or []
    if isinstance(replicas, str) or not isinstance(replicas, list):
        raise RouterConfigError(f"{where}: `replicas` is a list of URLs")
    prefill = d.get("prefill") or []
    if isinstance(prefill, str) or not isinstance(prefill, list):
        raise RouterConfigError(f"{where}: `prefill` is a list of URLs (prefill servers)")
    for u in [d["url"], *replicas, *prefill]:
        url = urlparse(u) if isinstance(u, str) else None
        if url is None or url.scheme not in ("http", "https") or not url.netloc:
            raise RouterConfigError(f"{where}: a URL must be http(s), such as http://127.0.0.1:8001/v1, not {u!r}")
    if len({u.rstrip("/") for u in [d["url"], *replicas, *prefill]}) != 1 + len(replicas) + len(prefill):
        raise RouterConfigError(f"{where}: the same URL twice among `url`, `replicas` and `prefill`")
    if d["name"].startswith("route:"):
        raise RouterConfigError(f"{where}: backend names cannot start with `route:` (that prefix selects a policy)")
    try:
        cost = float(d.get("cost_per_token", 0.0))
    except (TypeError, ValueError):
        raise RouterConfigError(f"{where}: `cost_per_token` must be a number") from None
    if cost < 0:
        raise RouterConfigError(f"{where}: `cost_per_token` must be >= 0")
    return Backend(name=d["name"], url=d["url"].rstrip("/"), model=d.get("model"), version=str(d.get("version", "1")),
                   cost_per_token=cost, api_key=d.get("api_key"), replicas=tuple(u.rstrip("/") for u in replicas),
                   prefill=tuple(u.rstrip("/") for u in prefill))


def parse_config(d: dict) -> RouterConfig:
    if not isinstance(d, dict):
        raise RouterConfigError("the router config is a JSON object")
    _unknown(d, _TOP_FIELDS, "config")
    raw = d.get("backends")
    if not isinstance(raw, list) or not raw:
        raise RouterConfigError("config: `backends` must be a non-empty list")
    backends: dict[str, Backend] = {}
    for i, b in enumerate(raw):
        backend = _backend(b, f"backends[{i}]")
        if backend.name in backends:
            raise RouterConfigError(f"backends[{i}]: duplicate backend name {backend.name!r}")
        backends[backend.name] = backend
    for role in ("weak", "strong"):
        if d.get(role) is not None and d[role] not in backends:
            raise RouterConfigError(f"config: `{role}` is {d[role]!r}, which is not a backend (have: {', '.join(backends)})")
    if d.get("weak") is not None and d.get("weak") == d.get("strong"):
        raise RouterConfigError("config: `weak` and `strong` must be different backends")
    aliases = d.get("aliases") or {}
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise RouterConfigError("config: `aliases` maps model names to routes, e.g. {\"auto\": \"route:cascade:-0.5\"}")
    for name, target in aliases.items():
        if name in backends:
            raise RouterConfigError(f"aliases: {name!r} is already a backend name")
        if not target.startswith("route:") and target not in backends:
            raise RouterConfigError(f"aliases: {name!r} -> {target!r} is neither a route (route:<policy>) nor a backend")
    cache = d.get("cache") or {}
    if not isinstance(cache, dict):
        raise RouterConfigError("config: `cache` is an object")
    _unknown(cache, _CACHE_FIELDS, "cache")
    cc = CacheConfig(**cache)
    if cc.backend not in ("memory", "redis", "none"):
        raise RouterConfigError(f"cache.backend: {cc.backend!r} is not one of memory, redis, none")
    for key in ("ttl", "stale_while_revalidate"):
        value = getattr(cc, key)
        if not isinstance(value, (int, float)) or value < 0:
            raise RouterConfigError(f"cache.{key} must be a number >= 0")
    if not isinstance(cc.max_entries, int) or cc.max_entries < 1:
        raise RouterConfigError("cache.max_entries must be a positive integer")
    if cc.semantic_threshold is not None and not 0.0 < cc.semantic_threshold <= 1.0:
        raise RouterConfigError("cache.semantic_threshold is a cosine similarity in (0, 1]")
    for key in ("timeout", "health_interval"):
        if key in d and (not isinstance(d[key], (int, float)) or d[key] <= 0):
            raise RouterConfigError(f"config: `{key}` must be a positive number of seconds")
    from sieve.router.balance import POLICIES

    if d.get("balance", "cache_aware") not in POLICIES:
        raise RouterConfigError(f"config: `balance` is one of {', '.join(POLICIES)}, not {d['balance']!r}")
    if not isinstance(d.get("balance_abs", 4), int) or d.get("balance_abs", 4) < 0:
        raise RouterConfigError("config: `balance_abs` is an integer >= 0")
    keys = d.get("api_keys") or {}
    if isinstance(keys, list):  # bare keys: each its own tenant
        from sieve.server.auth import default_tenant

        keys = {k: default_tenant(k) for k in keys if isinstance(k, str)} if all(isinstance(k, str) for k in keys) else None
    if not isinstance(keys, dict) or not all(isinstance(k, str) and k and isinstance(t, str) and t for k, t in keys.items()):
        raise RouterConfigError("config: `api_keys` maps client keys to tenant names, or lists keys")
    body_limit = d.get("max_body_bytes", 16 << 20)
    if isinstance(body_limit, bool) or not isinstance(body_limit, int) or body_limit < 1:
        raise RouterConfigError("config: `max_body_bytes` is a positive integer")
    config = RouterConfig(backends=backends, weak=d.get("weak"), strong=d.get("strong"), aliases=aliases,
                          classifier=d.get("classifier"), cache=cc, timeout=float(d.get("timeout", 600.0)),
                          health_interval=float(d.get("health_interval", 5.0)), balance=d.get("balance", "cache_aware"),
                          balance_abs=d.get("balance_abs", 4), api_keys=dict(keys), max_body_bytes=body_limit)
    if config.classifier is not None and not Path(config.classifier).is_file():
        raise RouterConfigError(f"config: `classifier` {config.classifier!r} is not a file (write one with `sieve router train`)")
    return config


def load_config(path: str | None, backends: list[str] | None = None, **overrides) -> RouterConfig:
    """A JSON file, then flags on top: `backends` as NAME=URL[,key=value...] (keys of a backend), `overrides`
    (weak, strong, classifier, cache fields as cache_<field>) where not None."""
    d: dict = {}
    if path is not None:
        try:
            d = json.loads(Path(path).read_text())
        except OSError as e:
            raise RouterConfigError(f"cannot read the router config {path}: {e}") from None
        except json.JSONDecodeError as e:
            raise RouterConfigError(f"{path} is not valid JSON: {e}") from None
    d = dict(d)
    if backends:
        d["backends"] = list(d.get("backends", [])) + [_backend_flag(s) for s in backends]
    cache = dict(d.get("cache") or {})
    for key, value in overrides.items():
        if value is None:
            continue
        if key.startswith("cache_"):
            cache[key[len("cache_"):]] = value
        else:
            d[key] = value
    if cache:
        d["cache"] = cache
    return parse_config(d)


def _backend_flag(s: str) -> dict:
    name, sep, rest = s.partition("=")
    if not sep or not name:
        raise RouterConfigError(f"--backend {s!r}: expected NAME=URL[,replica=URL...][,prefill=URL...][,model=ID][,version=V]"
                                "[,cost_per_token=C]")
    url, *pairs = rest.split(",")
    d: dict = {"name": name, "url": url}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise RouterConfigError(f"--backend {s!r}: {pair!r} is not key=value")
        if key in ("replica", "prefill"):
            d.setdefault("replicas" if key == "replica" else "prefill", []).append(value)
        else:
            d[key] = value
    return d
