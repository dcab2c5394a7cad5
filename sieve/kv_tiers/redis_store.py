"""A tier of KV blocks in Redis, shared by every replica that names it (`--kv-cache-remote redis://HOST:PORT/DB`).

Keys `sieve-kv:<fingerprint digest>:<chained block hash>`, each value one block in the KV transfer payload format,
with a MAC under the operator's secret (`--kv-cache-secret-file`, which every replica shares): the store is written
by other processes, so nothing in it is loaded unchecked. Room is Redis's own business (`maxmemory` with an LRU
policy, as an operator runs a cache); each key also expires after `ttl_s` unless read again.

Short socket timeouts, and after a failure the store is left alone for `BACKOFF_S`: an unreachable Redis costs a
request at most one timeout, then nothing until it is tried again; every failure is raised to the tiers, which
count it and recompute.
"""

from __future__ import annotations

import threading
import time

BACKOFF_S = 5.0


class StoreUnavailable(ConnectionError):
    """The store failed recently and is not being tried until its back-off ends."""


class RedisStore:
    name = "redis"

    def __init__(self, url: str, fingerprint: str, ttl_s: float = 7 * 24 * 3600, timeout_s: float = 0.5):
        import redis

        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.url, self.prefix, self.ttl_s = url, f"sieve-kv:{fingerprint}:", int(ttl_s)
        self.evictions = 0  # Redis evicts on its own; it does not say which
        self._known: set[str] = set()  # keys this process wrote or read: present, as far as it knows
        self._lock = threading.Lock()
        self._down_until = 0.0

    def __len__(self) -> int:
        return len(self._known)

    def knows(self, key: str) -> bool:
        """Cheap and local (the engine thread asks): a key this process has seen in the store."""
        return key in self._known

    def _call(self, fn):
        if time.monotonic() < self._down_until:
            raise StoreUnavailable(f"{self.url} failed less than {BACKOFF_S:g} s ago")
        try:
            return fn(self._client)
        except Exception:
            self._down_until = time.monotonic() + BACKOFF_S
            raise

    def has(self, key: str) -> bool:
        return bool(self._call(lambda c: c.exists(self.prefix + key)))

    def leading(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, the store holds: one round trip."""
        if not keys:
            return 0

        def ask(c):
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.prefix + k)
            return pipe.execute()

        n = 0
        for present in self._call(ask):
            if not present:
                break
            n += 1
        return n

    def read_many(self, keys: list[str]) -> list[bytes | None]:
        values = self._call(lambda c: c.mget([self.prefix + k for k in keys]))
        found = [k for k, v in zip(keys, values) if v is not None]
        if found:
            def touch(c):
                pipe = c.pipeline(transaction=False)
                for k in found:
                    pipe.expire(self.prefix + k, self.ttl_s)
                pipe.execute()
            try:
                self._call(touch)
            except Exception:  # noqa: BLE001 (the read succeeded; a missed refresh only shortens a key's life)
                pass
        with self._lock:
            self._known.update(found)
        return list(values)

    def read(self, key: str) -> bytes | None:
        return self.read_many([key])[0]

    def write(self, key: str, payload: bytes) -> bool:
        self._call(lambda c: c.set(self.prefix + key, payload, ex=self.ttl_s))
        with self._lock:
            self._known.add(key)
        return True

    def drop(self, key: str) -> None:
        with self._lock:
            self._known.discard(key)
        self._call(lambda c: c.delete(self.prefix + key))
