"""The response cache: content-addressed keys, TTL with stale-while-revalidate, an in-memory LRU or Redis.

- The key hashes the endpoint, the route (after aliases), the name and version of every backend that route can
  reach, and every other field of the body except how it is delivered (`stream`, `stream_options`). A new
  model version, or any change to a sampling field, is a new key.
- Only deterministic requests are cached by default: temperature 0, or a seed. Sampling without a seed asks
  for a fresh draw each time.
- A store that fails (Redis restarted, unreachable) never fails the request: the lookup is a miss, the write is
  skipped, and the error is counted.
- Semantic matching (opt-in) returns the answer to a near-identical prompt with the same fields. A guard
  refuses matches whose negations or numbers differ: "Is X safe?" and "Is X not safe?" embed close together
  (the false hits of GPTCache issue 694)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from sieve.router.embed import HashEmbedder, words

log = logging.getLogger("sieve.router")

DELIVERY_FIELDS = ("stream", "stream_options")
_NEGATIONS = {"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "without", "except", "cannot",
              "can't", "don't", "doesn't", "didn't", "isn't", "aren't", "wasn't", "weren't", "won't", "wouldn't",
              "shouldn't", "couldn't", "hasn't", "haven't", "hadn't", "mustn't", "least", "fewest", "false", "unsafe"}


class StoreError(Exception):
    pass


def is_deterministic(body: dict) -> bool:
    return body.get("seed") is not None or body.get("temperature") == 0


def cache_key(endpoint: str, route: str, backends: list[tuple[str, str]], body: dict, extra: str = "") -> str:
    fields = {k: v for k, v in body.items() if k not in DELIVERY_FIELDS and k != "model"}
    blob = json.dumps({"endpoint": endpoint, "route": route, "backends": sorted(backends), "body": fields, "extra": extra},
                      sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class Entry:
    response: dict  # the non-streamed response body
    headers: dict  # the routing headers it was answered with
    stored_at: float

    def to_json(self) -> str:
        return json.dumps({"response": self.response, "headers": self.headers, "stored_at": self.stored_at})

    @classmethod
    def from_json(cls, s: str | bytes) -> "Entry":
        d = json.loads(s)
        return cls(d["response"], d["headers"], float(d["stored_at"]))


class MemoryStore:
    name = "memory"

    def __init__(self, max_entries: int, clock=time.time):
        self.max_entries, self.clock = max_entries, clock
        self._d: OrderedDict[str, tuple[str, float]] = OrderedDict()

    async def get(self, key: str) -> str | None:
        hit = self._d.get(key)
        if hit is None:
            return None
        value, expires = hit
        if self.clock() >= expires:
            del self._d[key]
            return None
        self._d.move_to_end(key)
        return value

    async def set(self, key: str, value: str, ttl: float) -> None:
        self._d[key] = (value, self.clock() + ttl)
        self._d.move_to_end(key)
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)

    async def close(self) -> None:
        pass


class RedisStore:
    """redis-py's asyncio client with short timeouts: a dead Redis costs a request at most ~0.5 s, once per
    failure, and the client reconnects by itself when Redis is back."""

    name = "redis"
    prefix = "sieve:router:"

    def __init__(self, url: str, timeout: float = 0.5):
        import redis.asyncio as aredis

        self._client = aredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)

    async def get(self, key: str) -> str | None:
        try:
            return await self._client.get(self.prefix + key)
        except Exception as e:  # redis.ConnectionError, TimeoutError, OSError...
            raise StoreError(f"redis get: {e}") from e

    async def set(self, key: str, value: str, ttl: float) -> None:
        try:
            await self._client.set(self.prefix + key, value, px=max(1, int(ttl * 1000)))
        except Exception as e:
            raise StoreError(f"redis set: {e}") from e

    async def close(self) -> None:
        await self._client.aclose()


def negations_and_numbers(text: str) -> tuple[frozenset, tuple]:
    w = words(text)
    return frozenset(x for x in w if x in _NEGATIONS or x.endswith("n't")), tuple(x for x in w if x.isdigit())


class SemanticIndex:
    """Embeddings of cached prompts, grouped by every other field of the request; in the gateway's memory
    (bounded), pointing at keys in the store."""

    def __init__(self, threshold: float, embedder=None, max_entries: int = 10_000):
        self.threshold, self.max_entries = threshold, max_entries
        self.embedder = embedder or HashEmbedder()
        self._groups: dict[str, list[tuple[torch.Tensor, str, str]]] = {}
        self._count = 0

    def add(self, group: str, text: str, key: str) -> None:
        if self._count >= self.max_entries:
            self._groups.clear()
            self._count = 0
        self._groups.setdefault(group, []).append((self.embedder([text])[0], text, key))
        self._count += 1

    def lookup(self, group: str, text: str) -> tuple[str, float] | None:
        rows = self._groups.get(group)
        if not rows:
            return None
        v = self.embedder([text])[0]
        guard = negations_and_numbers(text)
        best = None
        for emb, other, key in rows:
            sim = float(emb @ v)
            if sim >= self.threshold and negations_and_numbers(other) == guard and (best is None or sim > best[1]):
                best = (key, sim)
        return best


class ResponseCache:
    def __init__(self, store, ttl: float, stale_while_revalidate: float, cache_sampled: bool = False,
                 semantic: SemanticIndex | None = None, clock=time.time):
        self.store, self.ttl, self.swr, self.cache_sampled = store, ttl, stale_while_revalidate, cache_sampled
        self.clock = clock  # wall-clock seconds (entries outlive the process in Redis); tests substitute their own
        self.semantic = semantic
        self.stats = {"hit": 0, "miss": 0, "stale": 0, "semantic_hit": 0, "error": 0, "bypass": 0}
        self._refreshing: set[str] = set()
        self._tasks: set[asyncio.Task] = set()  # held so that a running refresh is not garbage-collected

    def cacheable(self, body: dict) -> bool:
        return self.cache_sampled or is_deterministic(body)

    async def lookup(self, key: str) -> tuple[str, Entry | None]:
        """('hit' | 'stale' | 'miss', entry). A store error is a miss."""
        try:
            raw = await self.store.get(key)
        except StoreError as e:
            self.stats["error"] += 1
            log.warning("response cache unavailable, serving uncached: %s", e)
            return "miss", None
        if raw is None:
            return "miss", None
        try:
            entry = Entry.from_json(raw)
        except (ValueError, KeyError, TypeError):
            return "miss", None
        age = self.clock() - entry.stored_at
        if age < self.ttl:
            return "hit", entry
        if age < self.ttl + self.swr:
            return "stale", entry
        return "miss", None

    async def put(self, key: str, entry: Entry) -> None:
        try:
            await self.store.set(key, entry.to_json(), self.ttl + self.swr)
        except StoreError as e:
            self.stats["error"] += 1
            log.warning("response cache unavailable, answer not stored: %s", e)

    def refresh(self, key: str, make_entry) -> None:
        """Stale-while-revalidate: one refresh per key at a time, in the background."""
        if key in self._refreshing:
            return
        self._refreshing.add(key)

        async def run():
            try:
                entry = await make_entry()
                if entry is not None:
                    await self.put(key, entry)
            except Exception as e:  # the stale answer was served; the next request tries again
                log.warning("background refresh of a stale cache entry failed: %s", e)
            finally:
                self._refreshing.discard(key)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
