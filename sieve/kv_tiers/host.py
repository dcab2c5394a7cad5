"""A tier of KV blocks in host RAM, up to a byte capacity, least recently used out first (vLLM's
`--kv-offloading-size`): the tier below a GPU's pool, nearer than the disk. On a CPU the pool already lives in host
RAM, and this tier is memory beside it, outside the pool's budget.

Each block is held as the KV transfer payload the other tiers keep (its MAC checked when it is read back, as theirs
is), so one format moves a block between every tier. Lost at a restart: the disk tier is what survives one.

Thread safety: the index is changed under a lock; the tiers' writer thread writes, the engine and fetch threads read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from sieve.kv_tiers.local import LocalIndex


class HostStore(LocalIndex):
    name = "host"

    def __init__(self, capacity_bytes: int):
        self.capacity = int(capacity_bytes)
        self._lock = threading.Lock()
        self._blocks: OrderedDict[str, bytes] = OrderedDict()  # block hash (hex) -> payload, least recently used first
        self.bytes_held = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def has(self, key: str) -> bool:
        return key in self._blocks

    def read(self, key: str) -> bytes | None:
        with self._lock:
            payload = self._blocks.get(key)
            if payload is not None:
                self._blocks.move_to_end(key)
            return payload

    def write(self, key: str, payload: bytes) -> bool:
        """Keep one block; False when it is bigger than the whole tier."""
        if len(payload) > self.capacity:
            return False
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self.bytes_held -= len(old)
            self._blocks[key] = payload
            self.bytes_held += len(payload)
            while self.bytes_held > self.capacity:
                _, dropped = self._blocks.popitem(last=False)
                self.bytes_held -= len(dropped)
                self.evictions += 1
        return True

    def drop(self, key: str) -> None:
        with self._lock:
            payload = self._blocks.pop(key, None)
            if payload is not None:
                self.bytes_held -= len(payload)
