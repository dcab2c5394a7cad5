"""Tenants (`sieve serve --tenants FILE`): who each API key belongs to, the tier that tenant is served at, and its
limits. JSON or YAML:

```yaml
tiers:                         # a priority class each (0 is served first), and its guaranteed
  premium: {priority: 0, share: 0.5}   # share of the running slots (--max-num-seqs) while it has work
  free: {priority: 1, share: 0.25, max_waiting: 64}   # optional: past 64 of its requests waiting, 429
tenants:
  acme:
    keys: ["sk-acme-1"]        # plain keys, or
    key_sha256: ["9f86d0..."]  # their sha256 (hex), so that the file holds no secret
    tier: premium
    requests_per_minute: 600   # each limit optional: past one, 429 with Retry-After
    tokens_per_minute: 200000  # prompt tokens when admitted, generated tokens when finished
    max_concurrent: 32         # requests in flight
    share_prefix_cache: false  # true: its prompts share cached blocks with the other tenants that say so
```

A tier's requests are scheduled ahead of a lower tier's (sieve's priority scheduling: a waiting request of a
higher tier preempts a lower one's when blocks run out), but every tier keeps its guaranteed share of the running
slots while it has work, and the tenants of one tier are served by least service so far (sieve/tenancy.py). Anything the file says that
sieve does not know is an error naming it: a tenant served under a misspelt limit would be served without it.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from sieve.server.auth import APIKeys

TIER_STRIDE = 1 << 20  # an engine priority: tier priority x stride + the client's own (within --allow-client-priority)
OTHER = "other"  # the metrics label of a request whose tenant the file does not name
_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
_TENANT_FIELDS = {"keys", "key_sha256", "tier", "share_prefix_cache", *_LIMITS}
_TIER_FIELDS = {"priority", "share", "max_waiting"}


class TenantsError(ValueError):
    """The tenants file is wrong: the message names the file and the entry."""


@dataclass(frozen=True)
class Tier:
    name: str
    priority: int
    share: float = 0.0  # guaranteed fraction of the running slots (sieve/tenancy.py)
    max_waiting: int | None = None  # its requests that may wait at once (--max-waiting, for this tier alone)


@dataclass(frozen=True)
class Tenant:
    name: str
    tier: Tier
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    share_prefix_cache: bool = False


@dataclass
class Tenants:
    """The parsed file: every tenant by name, and the keys that name them."""

    by_name: dict[str, Tenant]
    keys: APIKeys

    @classmethod
    def load(cls, path: str) -> "Tenants":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise TenantsError(f"cannot read the tenants file {path}: {e}") from None
        try:
            data = json.loads(text) if path.endswith(".json") else _yaml(text)
        except ValueError as e:
            raise TenantsError(f"{path} does not parse: {e}") from None
        return cls.parse(data, path)

    @classmethod
    def parse(cls, data, where: str = "tenants") -> "Tenants":
        shape = f"{where}: expected an object with `tenants` (and `tiers`), each an object of named entries"
        if not isinstance(data, dict):
            raise TenantsError(shape)
        if _unknown(data, {"tiers", "tenants"}) or not isinstance(data.get("tenants"), dict) or \
                not isinstance(data.get("tiers") or {}, dict):
            raise TenantsError(shape + ";" + _unknown(data, {"tiers", "tenants"}))
        tiers = {"default": Tier("default", 0)}
        for name, spec in (data.get("tiers") or {}).items():
            tiers[str(name)] = _tier(str(name), spec, where)
        if sum(t.share for t in tiers.values()) > 1 + 1e-9:
            raise TenantsError(f"{where}: the tiers' shares add up to more than 1")
        by_name, plain, hashed = {}, {}, {}
        for name, spec in data["tenants"].items():
            name, at = str(name), f"{where}: tenants.{name}"
            if not isinstance(spec, dict):
                raise TenantsError(f"{at}: expected an object")
            if set(spec) - _TENANT_FIELDS:
                raise TenantsError(f"{at}:{_unknown(spec, _TENANT_FIELDS)}")
            tier = tiers.get(str(spec.get("tier", "default")))
            if tier is None:
                raise TenantsError(f"{at}: tier {spec['tier']!r} is not among tiers ({', '.join(tiers)})")
            limits = {}
            for key in _LIMITS:
                value = spec.get(key)
                if value is not None and not _int(value, lo=1):
                    raise TenantsError(f"{at}.{key}: expected a whole number >= 1, got {value!r}")
                limits[key] = value
            share = spec.get("share_prefix_cache", False)
            if not isinstance(share, bool):
                raise TenantsError(f"{at}.share_prefix_cache: expected true or false")
            for field, table, check in (("keys", plain, _plain_key), ("key_sha256", hashed, _sha256)):
                values = spec.get(field, [])
                if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                    raise TenantsError(f"{at}.{field}: expected a list of strings")
                for v in values:
                    v = check(v, f"{at}.{field}")
                    if v in table or (field == "keys" and _digest(v) in hashed) or (field == "key_sha256" and
                                                                                   v in {_digest(k) for k in plain}):
                        raise TenantsError(f"{at}.{field}: a key is given twice")
                    table[v] = name
            if not spec.get("keys") and not spec.get("key_sha256"):
                raise TenantsError(f"{at}: no keys (`keys` or `key_sha256`)")
            by_name[name] = Tenant(name, tier, share_prefix_cache=share, **limits)
        if not by_name:
            raise TenantsError(f"{where}: no tenants")
        return cls(by_name, APIKeys(plain, hashed=hashed))

    def tenant(self, name: str | None) -> Tenant | None:
        return self.by_name.get(name or "")

    @property
    def caps_waiting(self) -> bool:
        """Whether a tier has a `max_waiting` of its own."""
        return any(t.tier.max_waiting is not None for t in self.by_name.values())

    def tier_shares(self) -> dict[str, float]:
        """Each tier's guaranteed share of the running slots, for the engine (EngineConfig.tier_shares)."""
        return {t.tier.name: t.tier.share for t in self.by_name.values()}

    def label(self, name: str | None) -> str:
        """The tenant as a metrics label: its name, or `other` for any name the file does not hold."""
        return name if name in self.by_name else OTHER


class Limited(Exception):
    """A tenant's limit refuses a request: `retry_after_s` until it would not."""

    def __init__(self, message: str, limit: str, retry_after_s: float):
        super().__init__(message)
        self.limit, self.retry_after_s = limit, retry_after_s


class TenantLimiter:
    """Each tenant's requests and tokens over the last minute, and its requests in flight. Thread-safe: requests are
    admitted on the event loop, their generated tokens counted from the engine thread."""

    WINDOW_S = 60.0

    def __init__(self, tenants: Tenants, clock=time.monotonic):
        self.tenants, self.clock = tenants, clock
        self._lock = threading.Lock()
        self._requests: dict[str, deque] = {}  # tenant -> admission times
        self._tokens: dict[str, deque] = {}  # tenant -> [time, tokens]
        self._in_flight: dict[str, int] = {}

    def admit(self, name: str, prompt_tokens: int) -> None:
        """Count one request of `prompt_tokens` for tenant `name`; Limited (counting nothing) where a limit refuses
        it. Every admitted request is `release`d once."""
        t = self.tenants.tenant(name)
        if t is None:
            return
        now = self.clock()
        with self._lock:
            reqs = self._trim(self._requests.setdefault(name, deque()), now)
            toks = self._trim(self._tokens.setdefault(name, deque()), now)
            if t.max_concurrent is not None and self._in_flight.get(name, 0) >= t.max_concurrent:
                raise Limited(f"tenant {name!r} has {t.max_concurrent} requests in flight, its max_concurrent",
                              "max_concurrent", 1.0)
            if t.requests_per_minute is not None and len(reqs) >= t.requests_per_minute:
                raise Limited(f"tenant {name!r} made {t.requests_per_minute} requests in the last minute, its "
                              "requests_per_minute", "requests_per_minute", reqs[0] + self.WINDOW_S - now)
            used = sum(n for _, n in toks)
            if t.tokens_per_minute is not None and used >= t.tokens_per_minute:
                wait, left = 0.0, used
                for at, n in toks:  # until enough of the window's tokens have left it
                    left -= n
                    wait = at + self.WINDOW_S - now
                    if left < t.tokens_per_minute:
                        break
                raise Limited(f"tenant {name!r} used {used} tokens in the last minute, its tokens_per_minute is "
                              f"{t.tokens_per_minute}", "tokens_per_minute", wait)
            reqs.append(now)
            toks.append((now, prompt_tokens))
            self._in_flight[name] = self._in_flight.get(name, 0) + 1

    def release(self, name: str) -> None:
        with self._lock:
            if self._in_flight.get(name, 0) > 0:
                self._in_flight[name] -= 1

    def count_generated(self, name: str, tokens: int) -> None:
        if self.tenants.tenant(name) is None or not tokens:
            return
        with self._lock:
            self._tokens.setdefault(name, deque()).append((self.clock(), tokens))

    def _trim(self, window: deque, now: float) -> deque:
        while window and (window[0] if isinstance(window[0], float) else window[0][0]) <= now - self.WINDOW_S:
            window.popleft()
        return window


def _yaml(text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(str(e).replace("\n", " ")) from None


def _int(value, lo: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo


def _tier(name: str, spec, where: str) -> Tier:
    share = spec.get("share", 0.0) if isinstance(spec, dict) else None
    waiting = spec.get("max_waiting") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or set(spec) - _TIER_FIELDS or not _int(spec.get("priority", 0), lo=0) \
            or isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1 \
            or (waiting is not None and not _int(waiting, lo=1)):
        raise TenantsError(f"{where}: tiers.{name}: expected {{priority: a whole number >= 0, share: a fraction of "
                           "the running slots in [0, 1], max_waiting: a whole number >= 1 (optional)}"
                           + _unknown(spec, _TIER_FIELDS))
    return Tier(name, int(spec.get("priority", 0)), float(share), None if waiting is None else int(waiting))


def _unknown(spec, known: set) -> str:
    extra = sorted(set(spec) - known) if isinstance(spec, dict) else []
    return f" unknown field {extra[0]!r}" if extra else ""


def _plain_key(key: str, where: str) -> str:
    if not key.strip() or key != key.strip():
        raise TenantsError(f"{where}: a key is empty or has surrounding spaces")
    return key


def _sha256(value: str, where: str) -> str:
    v = value.strip().lower()
    if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
        raise TenantsError(f"{where}: {value!r} is not a sha256 hex digest (64 hex digits)")
    return v


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
