"""KV transfer between engines: prefill/decode disaggregation, in the shape of vLLM's KV connector.

A prefill engine (`--role prefill`, vLLM's kv_producer) runs a request with `kv_transfer_params: {"do_remote_decode":
true}` and `max_tokens` 1; when it finishes, the connector saves the KV of the prompt's full blocks, keyed by the
chained block hashes the prefix cache already computes, and the response carries `kv_transfer_params` saying where
they are (`do_remote_prefill`, `remote_host`, `remote_port`, `remote_block_hashes`, ...). A decode engine (`--role
decode`, kv_consumer) given those params fetches the blocks before it schedules the request and enters them in its
prefix cache, so the scheduler sees them as a cache hit and computes only the rest (at least the last prompt token,
whose logits it samples from). vLLM's proxies pass the same fields; the router does it (sieve/router).

Every block travels with its token ids, the engines' KV layout (model, dtypes, block size, shapes) and a checksum.
A block that is missing (lease expired, producer gone), corrupt, of another layout or of other tokens ends the
transfer there: the decode engine computes the rest itself. A transfer never produces a wrong token, only a slower one.

Transports: `tcp` (the producer serves its blocks on a port; between hosts) and `shm` (files in a shared-memory
directory, /dev/shm; one host). The producer holds saved blocks under a lease (`lease_s`) and drops them when it
expires or when the consumer has taken them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("sieve")

MAGIC = b"SVKV1"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both",
         "kv_producer": "kv_producer", "kv_consumer": "kv_consumer", "kv_both": "kv_both"}


class KVTransferError(ValueError):
    """A block that cannot be used (the reason names why); the transfer stops there and the rest is computed."""


@dataclass
class KVTransferConfig:
    """vLLM's kv_transfer_config fields where they exist (kv_role, kv_ip, kv_port), plus the transport and the lease."""

    kv_role: str = "kv_both"  # kv_producer (prefill) | kv_consumer (decode) | kv_both
    transport: str = "tcp"  # tcp | shm
    kv_ip: str = "127.0.0.1"  # the address a consumer reaches this producer at
    kv_port: int = 0  # 0: any free port
    lease_s: float = 120.0  # how long saved blocks are held for a consumer
    shm_dir: str | None = None  # shm transport: where blocks are written (default /dev/shm/sieve-kv-<pid>)
    connect_timeout_s: float = 5.0

    _FIELDS = ("kv_role", "transport", "kv_ip", "kv_port", "lease_s", "shm_dir", "connect_timeout_s", "kv_connector")

    @classmethod
    def parse(cls, value, role: str | None = None) -> "KVTransferConfig":
        from sieve.config import ConfigError

        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"kv_transfer_config is not valid JSON: {e}") from None
        value = dict(value or {})
        if not isinstance(value, dict):
            raise ConfigError("kv_transfer_config must be a JSON object")
        unknown = sorted(set(value) - set(cls._FIELDS))
        if unknown:
            raise ConfigError(f"kv_transfer_config: unknown field(s) {', '.join(unknown)} (known: {', '.join(cls._FIELDS)})")
        value.pop("kv_connector", None)  # any name: sieve has one connector
        if role is not None:
            value["kv_role"] = role
        cfg = cls(**value)
        if cfg.kv_role not in ROLES:
            raise ConfigError(f"role must be prefill, decode or both (or vLLM's kv_producer, kv_consumer, kv_both), got {cfg.kv_role!r}")
        cfg.kv_role = ROLES[cfg.kv_role]
        if cfg.transport not in ("tcp", "shm"):
            raise ConfigError(f"kv_transfer_config transport must be tcp or shm, got {cfg.transport!r}")
        if not (isinstance(cfg.kv_port, int) and 0 <= cfg.kv_port < 65536):
            raise ConfigError(f"kv_port must be a port number, got {cfg.kv_port!r}")
        if not cfg.lease_s > 0 or not cfg.connect_timeout_s > 0:
            raise ConfigError("kv_transfer_config lease_s and connect_timeout_s must be > 0")
        return cfg

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


# ---- one block on the wire ---------------------------------------------------------------------
def encode_block(block_hash: str, token_ids: list[int], layout: str, parts: list[torch.Tensor]) -> bytes:
    """MAGIC, header length, JSON header (hash, tokens, layout, byte size of each part), the parts' bytes, checksum."""
    raw = [p.contiguous().view(torch.uint8).reshape(-1).cpu().numpy().tobytes() for p in parts]
    header = json.dumps({"hash": block_hash, "tokens": token_ids, "layout": layout, "sizes": [len(r) for r in raw]}).encode()
    body = MAGIC + struct.pack(">I", len(header)) + header + b"".join(raw)
    return body + hashlib.blake2b(body, digest_size=16).digest()


def decode_block(payload: bytes, layout: str, token_ids: list[int], parts: list[torch.Tensor]) -> list[bytes]:
    """The parts' bytes of a payload that checks out against this engine: intact, same layout, same tokens, same sizes."""
    if len(payload) < len(MAGIC) + 4 + 16 or not payload.startswith(MAGIC):
        raise KVTransferError("not a KV block")
    body, digest = payload[:-16], payload[-16:]
    if hashlib.blake2b(body, digest_size=16).digest() != digest:
        raise KVTransferError("checksum mismatch")
    n = struct.unpack(">I", body[len(MAGIC) : len(MAGIC) + 4])[0]
    start = len(MAGIC) + 4
    header = json.loads(body[start : start + n])
    if header["layout"] != layout:
        raise KVTransferError("KV layout differs (another model, dtype, KV dtype or block size)")
    if header["tokens"] != token_ids:
        raise KVTransferError("block holds other tokens")
    sizes = [p.numel() * p.element_size() for p in parts]
    if header["sizes"] != sizes:
        raise KVTransferError("block sizes differ")
    out, at = [], start + n
    for size in sizes:
        out.append(body[at : at + size])
        at += size
    if at != len(body):
        raise KVTransferError("block length differs")
    return out


# ---- the producer's store and its transports -------------------------------------------------------
class BlockStore:
    """Saved blocks under a lease, served over TCP (in memory) or written to a shared-memory directory."""

    def __init__(self, cfg: KVTransferConfig):
        self.cfg = cfg
        self._blocks: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()
        self.server = None
        self.port = 0
        self.shm_dir = None
        if cfg.transport == "tcp":
            store = self

            class Handler(socketserver.StreamRequestHandler):
                def handle(self) -> None:
                    try:
                        request = json.loads(self.rfile.readline())
                        hashes = [str(h) for h in request.get("hashes", [])]
                    except (ValueError, AttributeError):
                        return
                    for h in hashes:
                        payload = store.get(h)
                        self.wfile.write(struct.pack(">Q", len(payload or b"")) + (payload or b""))
                    if request.get("release"):
                        store.release(hashes)

            class Server(socketserver.ThreadingTCPServer):
                allow_reuse_address = True
                daemon_threads = True

            self.server = Server(("0.0.0.0" if cfg.kv_ip not in ("127.0.0.1", "localhost") else "127.0.0.1", cfg.kv_port), Handler)
            self.port = self.server.server_address[1]
            threading.Thread(target=self.server.serve_forever, name="sieve-kv-server", daemon=True).start()
        else:
            self.shm_dir = Path(cfg.shm_dir or f"/dev/shm/sieve-kv-{os.getpid()}")
            self.shm_dir.mkdir(parents=True, exist_ok=True)

    def put(self, block_hash: str, payload: bytes) -> None:
        expires = time.monotonic() + self.cfg.lease_s
        if self.shm_dir is not None:
            tmp = self.shm_dir / f".{block_hash}.tmp"
            tmp.write_bytes(payload)
            os.replace(tmp, self.shm_dir / f"{block_hash}.kv")  # a reader sees the whole block or none
        with self._lock:
            self._blocks[block_hash] = (b"" if self.shm_dir is not None else payload, expires)
        self.sweep()

    def get(self, block_hash: str) -> bytes | None:
        with self._lock:
            item = self._blocks.get(block_hash)
        if item is None or item[1] < time.monotonic():
            return None
        return item[0]

    def release(self, hashes: list[str]) -> None:
        with self._lock:
            for h in hashes:
                self._blocks.pop(h, None)
        if self.shm_dir is not None:
            for h in hashes:
                (self.shm_dir / f"{h}.kv").unlink(missing_ok=True)

    def sweep(self) -> None:
        """Drop blocks whose lease expired."""
        now = time.monotonic()
        with self._lock:
            expired = [h for h, (_, t) in self._blocks.items() if t < now]
        if expired:
            self.release(expired)

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._blocks)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        if self.shm_dir is not None:
            with self._lock:
                held = list(self._blocks)
            self.release(held)


def fetch_blocks(params: dict, timeout_s: float) -> list[bytes | None]:
    """The consumer's side: the payloads of `remote_block_hashes` from the producer named in `params` (None: missing)."""
    hashes = [str(h) for h in params.get("remote_block_hashes") or []]
    if not hashes:
        return []
    if not all(len(h) == 32 and all(c in "0123456789abcdef" for c in h) for h in hashes):  # names, never paths
        raise KVTransferError("remote_block_hashes are not block hashes")
    if params.get("transport") == "shm":
        folder = Path(str(params.get("remote_shm_dir", "")))
        out = []
        for h in hashes:
            f = folder / f"{h}.kv"
            out.append(f.read_bytes() if f.is_file() else None)
            f.unlink(missing_ok=True)  # taken: the producer's lease need not keep it
        return out
    with socket.create_connection((str(params["remote_host"]), int(params["remote_port"])), timeout=timeout_s) as s:
        s.sendall(json.dumps({"hashes": hashes, "release": True}).encode() + b"\n")
        f = s.makefile("rb")
        out = []
        for _ in hashes:
            head = f.read(8)
            if len(head) < 8:
                raise KVTransferError("the producer closed the connection mid-transfer")
            size = struct.unpack(">Q", head)[0]
            payload = f.read(size) if size else b""
            if len(payload) < size:
                raise KVTransferError("the producer closed the connection mid-transfer")
            out.append(payload or None)
        return out


@dataclass
class TransferStats:
    """What /metrics reports: bytes, blocks and seconds per direction (save on a producer, load on a consumer), and
    transfers that fell back to computing locally, by reason."""

    bytes: Counter = field(default_factory=Counter)
    blocks: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)


class KVConnector:
    """One engine's end of KV transfer. `runner` gives the pool's per-block tensors (`block_tensors`); `blocks` (the
    block manager) names blocks by chained hash and takes imported ones into its prefix cache."""

    def __init__(self, cfg: KVTransferConfig, layout: str, runner, blocks, engine_id: str):
        self.cfg, self.layout, self.runner, self.blocks, self.engine_id = cfg, layout, runner, blocks, engine_id
        self.stats = TransferStats()
        self.store = BlockStore(cfg) if cfg.produces else None
        if self.store is not None:
            where = f"{cfg.kv_ip}:{self.store.port}" if cfg.transport == "tcp" else str(self.store.shm_dir)
            log.info("KV transfer: %s, serving saved blocks over %s at %s (lease %g s)", cfg.kv_role, cfg.transport, where, cfg.lease_s)
        else:
            log.info("KV transfer: %s", cfg.kv_role)

    # ---- producer ------------------------------------------------------------------------------
    def save(self, seq) -> dict:
        """After `seq` (a finished prefill) ran: save its prompt's full blocks; the params a consumer needs."""
        started = time.perf_counter()
        bs = self.blocks.block_size
        hashes = self.blocks.prompt_hashes(seq.token_ids[: seq.num_prompt_tokens])
        saved = []
        for j, h in enumerate(hashes):
            block = self.blocks.cached_block(h)
            if block is None:  # evicted already (or never cached): the consumer computes from here
                break
            payload = encode_block(h.hex(), seq.token_ids[j * bs : (j + 1) * bs], self.layout, self.runner.block_tensors(block))
            self.store.put(h.hex(), payload)
            saved.append(h.hex())
            self.stats.bytes["save"] += len(payload)
        self.stats.blocks["save"] += len(saved)
        self.stats.seconds["save"] += time.perf_counter() - started
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                  "remote_block_hashes": saved, "remote_num_tokens": len(saved) * bs, "transport": self.cfg.transport,
                  "kv_layout": self.layout}
        if self.cfg.transport == "tcp":
            params.update(remote_host=self.cfg.kv_ip, remote_port=self.store.port)
        else:
            params["remote_shm_dir"] = str(self.store.shm_dir)
        return params

    # ---- consumer ------------------------------------------------------------------------------
    def load(self, token_ids: list[int], params: dict) -> int:
        """Before a request with `do_remote_prefill` is scheduled: fetch its blocks and enter the good leading ones in
        the prefix cache. Returns the prompt tokens that will not be computed here; never raises for a bad transfer."""
        started = time.perf_counter()
        try:
            return self._load(token_ids, params)
        except (OSError, KVTransferError, ValueError, KeyError, TypeError) as e:
            self._fallback(type(e).__name__ if not isinstance(e, KVTransferError) else str(e), e)
            return 0
        finally:
            self.stats.seconds["load"] += time.perf_counter() - started

    def _load(self, token_ids: list[int], params: dict) -> int:
        if params.get("kv_layout") not in (None, self.layout):
            raise KVTransferError("KV layout differs (another model, dtype, KV dtype or block size)")
        bs = self.blocks.block_size
        # never the whole prompt: its last token is computed here, for the logits the first sample needs
        mine = self.blocks.prompt_hashes(token_ids)[: (len(token_ids) - 1) // bs]
        payloads = fetch_blocks(params, self.cfg.connect_timeout_s)[: len(mine)]
        probe = self.runner.block_tensors(0)
        good = []
        for j, payload in enumerate(payloads):
            if payload is None:
                self._fallback("missing block", None)
                break
            try:
                good.append(decode_block(payload, self.layout, token_ids[j * bs : (j + 1) * bs], probe))
            except KVTransferError as e:
                self._fallback(str(e), None)
                break
            self.stats.bytes["load"] += len(payload)
        targets = self.blocks.import_cached(mine[: len(good)])
        for j, block in targets:
            for dst, raw in zip(self.runner.block_tensors(block), good[j]):
                src = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dst.dtype).reshape(dst.shape)
                dst.copy_(src.to(dst.device))  # dst is a strided view of the pool: copied in place
        self.stats.blocks["load"] += len(good)
        return len(good) * bs

    def _fallback(self, reason: str, error: Exception | None) -> None:
        self.stats.fallbacks[reason] += 1
        log.warning("KV transfer: %s%s; computing the rest of the prompt here", reason, f" ({error})" if error else "")

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
