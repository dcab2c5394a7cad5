"""The producer's saved blocks and the two ways a consumer reaches them.

`BlockStore` holds a prefill server's exported blocks under a lease, up to a byte cap (an export past it is refused),
swept by a timer. Over `tcp` it serves them on the KV port: bound exactly where told, one short challenge-response per
connection (the port key, see kv_auth.py), a bounded request line and a deadline per connection, a bounded number of
connections at once. Over `shm` it writes them as files (mode 0600) in a directory of its own (mode 0700).

`fetch_tcp` and `fetch_shm` are the consumer's side: a total deadline for the whole transfer (not per socket
operation), and every announced size checked against what a block of this layout can be before anything is
allocated for it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import stat
import struct
import threading
import time
from collections import Counter
from pathlib import Path

from sieve.distributed.kv_auth import KVAuth, check_private_dir, private_dir

log = logging.getLogger("sieve")

MAX_REQUEST_LINE = 1 << 20  # the consumer's request: hashes of at most max_blocks_per_request blocks
MAX_CONNECTIONS = 16


class KVTransferError(ValueError):
    """A block that cannot be used (the reason names why); the transfer stops there and the rest is computed."""


class StoreFull(KVTransferError):
    pass


class BlockStore:
    """Saved blocks under a lease and a byte cap, served over TCP (in memory) or written to a private directory."""

    def __init__(self, cfg, auth: KVAuth):
        self.cfg, self.auth = cfg, auth
        self._blocks: dict[str, tuple[bytes, float, int]] = {}  # hash -> (payload, lease end, size)
        self._lock = threading.Lock()
        self.bytes_held = 0
        self.refused: Counter = Counter()  # connections and exports turned away, by reason
        self.server = None
        self.port = 0
        self.shm_dir = None
        self._closed = threading.Event()
        if cfg.transport == "tcp":
            self._serve_tcp()
        else:
            self.shm_dir = private_dir(cfg.shm_dir)
        self._sweeper = threading.Thread(target=self._sweep_until_closed, name="sieve-kv-sweep", daemon=True)
        self._sweeper.start()

    # ---- the store ---------------------------------------------------------------------------
    def has_room(self, nbytes: int) -> bool:
        return self.bytes_held + nbytes <= self.cfg.max_store_bytes

    def put(self, block_hash: str, payload: bytes) -> None:
        self.release([block_hash])  # a block exported again replaces the old copy
        with self._lock:
            if self.bytes_held + len(payload) > self.cfg.max_store_bytes:
                self.refused["store_full"] += 1
                raise StoreFull(f"the KV store holds {self.bytes_held} bytes, its cap (max_store_bytes) is "
                                f"{self.cfg.max_store_bytes}")
            self.bytes_held += len(payload)  # reserved before the file exists; entered once it does (a sweep drops
        try:  # an shm entry whose file is gone)
            if self.shm_dir is not None:
                tmp = self.shm_dir / f".{block_hash}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(payload)
                os.replace(tmp, self.shm_dir / f"{block_hash}.kv")  # a reader sees the whole block or none
        except BaseException:
            with self._lock:
                self.bytes_held -= len(payload)
            raise
        with self._lock:
            self._blocks[block_hash] = (b"" if self.shm_dir is not None else payload, time.monotonic() + self.cfg.lease_s, len(payload))

    def get(self, block_hash: str) -> bytes | None:
        with self._lock:
            item = self._blocks.get(block_hash)
        if item is None or item[1] < time.monotonic():
            return None
        return item[0]

    def release(self, hashes: list[str]) -> None:
        with self._lock:
            for h in hashes:
                item = self._blocks.pop(h, None)
                if item is not None:
                    self.bytes_held -= item[2]
        if self.shm_dir is not None:
            for h in hashes:
                (self.shm_dir / f"{h}.kv").unlink(missing_ok=True)

    def sweep(self) -> None:
        """Drop blocks whose lease expired, and (shm) those a consumer has taken: it removes their files."""
        now = time.monotonic()
        with self._lock:
            expired = [h for h, item in self._blocks.items() if item[1] < now
                       or (self.shm_dir is not None and not (self.shm_dir / f"{h}.kv").exists())]
        if expired:
            self.release(expired)

    def _sweep_until_closed(self) -> None:
        while not self._closed.wait(min(1.0, self.cfg.lease_s / 2)):
            self.sweep()

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._blocks)

    def close(self) -> None:
        self._closed.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        with self._lock:
            held = list(self._blocks)
        self.release(held)
        if self.shm_dir is not None:
            for leftover in self.shm_dir.glob(".*.tmp"):
                leftover.unlink(missing_ok=True)
            try:
                self.shm_dir.rmdir()
            except OSError:
                pass

    # ---- the KV port -------------------------------------------------------------------------
    def _serve_tcp(self) -> None:
        store, slots = self, threading.BoundedSemaphore(MAX_CONNECTIONS)

        class Handler(socketserver.StreamRequestHandler):
            timeout = self.cfg.connect_timeout_s  # each read and write; the whole exchange is bounded below too

            def handle(self) -> None:
                if not slots.acquire(blocking=False):
                    store.refused["too_many_connections"] += 1
                    return
                try:
                    store._answer(self.rfile, self.wfile, time.monotonic() + store.cfg.transfer_timeout_s)
                except socket.timeout:
                    store.refused["timeout"] += 1
                except (OSError, ValueError) as e:
                    log.debug("KV port: %s", e)
                finally:
                    slots.release()

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True
            address_family = socket.AF_INET6 if ":" in self.cfg.kv_ip else socket.AF_INET

        self.server = Server((self.cfg.kv_ip, self.cfg.kv_port), Handler)  # where told: never widened
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="sieve-kv-server", daemon=True).start()

    def _answer(self, rfile, wfile, deadline: float) -> None:
        challenge = self.auth.challenge()
        wfile.write(challenge + b"\n")
        wfile.flush()
        line = rfile.readline(MAX_REQUEST_LINE + 1)
        if not line.endswith(b"\n") or time.monotonic() > deadline:
            self.refused["bad_request"] += 1
            return
        try:
            request = json.loads(line)
            hashes, release, mac = request["hashes"], bool(request.get("release")), request.get("mac")
            if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            self.refused["bad_request"] += 1
            return
        if len(hashes) > self.cfg.max_blocks_per_request or not self.auth.answer_ok(challenge, {"hashes": hashes, "release": release}, mac):
            self.refused["unauthenticated"] += 1
            return
        for h in hashes:
            if time.monotonic() > deadline:
                return
            payload = self.get(h) or b""
            wfile.write(struct.pack(">Q", len(payload)) + payload)
        wfile.flush()
        if release:
            self.release(hashes)


# ---- the consumer's side ---------------------------------------------------------------------
class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise KVTransferError("the transfer passed its deadline (transfer_timeout_s)")
        return left


def _recv_exactly(sock: socket.socket, n: int, deadline: Deadline) -> bytes:
    buf, got = bytearray(n), 0
    view = memoryview(buf)
    while got < n:
        sock.settimeout(deadline.left())
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            raise KVTransferError("the transfer passed its deadline (transfer_timeout_s)") from None
        if k == 0:
            raise KVTransferError("the producer closed the connection mid-transfer")
        got += k
    return bytes(buf)


def _recv_line(sock: socket.socket, limit: int, deadline: Deadline) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        if len(line) >= limit:
            raise KVTransferError("the producer's challenge is too long")
        line += _recv_exactly(sock, 1, deadline)
    return line[:-1]


def fetch_tcp(host: str, port: int, hashes: list[str], auth: KVAuth, max_block_bytes: int, cfg) -> list[bytes | None]:
    deadline = Deadline(cfg.transfer_timeout_s)
    with socket.create_connection((host, port), timeout=min(cfg.connect_timeout_s, deadline.left())) as s:
        challenge = _recv_line(s, 64, deadline)
        request = {"hashes": hashes, "release": True}
        s.settimeout(deadline.left())
        s.sendall(json.dumps(dict(request, mac=auth.answer(challenge, request))).encode() + b"\n")
        out = []
        for _ in hashes:
            size = struct.unpack(">Q", _recv_exactly(s, 8, deadline))[0]
            if size > max_block_bytes:  # before any allocation: a block of this layout is never larger
                raise KVTransferError(f"the producer announced a block of {size} bytes, over the {max_block_bytes} a block can be")
            out.append(_recv_exactly(s, size, deadline) if size else None)
        return out


def fetch_shm(folder: str, hashes: list[str], max_block_bytes: int, cfg) -> list[bytes | None]:
    deadline = Deadline(cfg.transfer_timeout_s)
    root = Path(folder)
    try:
        check_private_dir(root)
    except (OSError, ValueError):
        raise KVTransferError("the shm directory is not private to this user") from None
    out = []
    for h in hashes:
        deadline.left()
        try:
            fd = os.open(root / f"{h}.kv", os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            out.append(None)
            continue
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise KVTransferError("a block file is not a regular file of this user's")
            if st.st_size > max_block_bytes:
                raise KVTransferError(f"a block file of {st.st_size} bytes, over the {max_block_bytes} a block can be")
            out.append(f.read(max_block_bytes + 1))
        (root / f"{h}.kv").unlink(missing_ok=True)  # taken: the producer's lease need not keep it
    return out
