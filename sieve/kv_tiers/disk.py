"""A tier of KV blocks in files: one file per block in a directory of its own per KV fingerprint, up to a byte
capacity, least recently used out first.

`<root>/<fingerprint digest>/<chained block hash>.kv`, each file one block in the KV transfer payload format
(sieve/distributed/kv_transfer.py: header, parts, MAC over the bytes and the block's tokens). The index is the
directory itself: read at start (oldest modification first, so a restart keeps the order of use) and kept in
memory after. Writes go to a temporary name and are renamed into place, so a reader never sees half a block and a
crash leaves at worst a stray temporary file (removed at the next start). `root` is made private (mode 0700);
an existing one must already be private to this user.

Thread safety: the index is changed under a lock; the tiers' writer thread writes, the engine and fetch threads
read (`has`, `leading`, `read_many`).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

from sieve.kv_tiers.local import LocalIndex

SUFFIX = ".kv"


class DiskStore(LocalIndex):
    name = "disk"

    def __init__(self, root: str | Path, fingerprint: str, capacity_bytes: int, read_delay_s: float = 0.0):
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError(f"{self.root} must be a directory private to this user (mode 700): it holds KV blocks "
                             "the server will load")
        self.dir = self.root / fingerprint
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self.capacity = int(capacity_bytes)
        self.read_delay_s = read_delay_s  # an injected slow tier (benchmarks, tests): seconds per block read
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # block hash (hex) -> bytes, least recently used first
        self.bytes_held = 0
        self.evictions = 0
        entries = []
        for p in self.dir.iterdir():
            if p.name.startswith(".tmp-"):
                p.unlink(missing_ok=True)
            elif p.suffix == SUFFIX and p.is_file():
                s = p.stat()
                entries.append((s.st_mtime, p.stem, s.st_size))
        for _, key, size in sorted(entries):
            self._index[key] = size
            self.bytes_held += size
        self._evict_to(self.capacity)

    def __len__(self) -> int:
        return len(self._index)

    def has(self, key: str) -> bool:
        return key in self._index

    def write(self, key: str, payload: bytes) -> bool:
        """Store one block (an OSError, e.g. a full disk, is the caller's to count). False when it is too big to keep."""
        if len(payload) > self.capacity:
            return False
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
        tmp = self.dir / f".tmp-{key}-{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(payload)
            os.replace(tmp, self.dir / (key + SUFFIX))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._index[key] = len(payload)
            self.bytes_held += len(payload)
            self._evict_to(self.capacity)
        return True

    def read(self, key: str) -> bytes | None:
        """One block's payload, or None where it is gone (evicted, or removed by hand)."""
        if key not in self._index:
            return None
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        try:
            data = (self.dir / (key + SUFFIX)).read_bytes()
        except FileNotFoundError:
            self.drop(key)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        try:
            os.utime(self.dir / (key + SUFFIX))  # the order of use survives a restart
        except OSError:
            pass
        return data

    def drop(self, key: str) -> None:
        """Remove a block (it failed its check, or belongs to nobody)."""
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.bytes_held -= size
        (self.dir / (key + SUFFIX)).unlink(missing_ok=True)

    def _evict_to(self, limit: int) -> None:
        """Under the lock: oldest blocks out until at most `limit` bytes are held."""
        while self.bytes_held > limit and self._index:
            key, size = self._index.popitem(last=False)
            self.bytes_held -= size
            self.evictions += 1
            (self.dir / (key + SUFFIX)).unlink(missing_ok=True)
