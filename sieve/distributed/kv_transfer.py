"""KV transfer between engines: prefill/decode disaggregation, in the shape of vLLM's KV connector.

A prefill engine (`--role prefill`, vLLM's kv_producer) runs a request with `kv_transfer_params: {"do_remote_decode":
true}` and `max_tokens` 1; when it finishes, the connector saves the KV of the prompt's full blocks, keyed by the
chained block hashes the prefix cache already computes, and the response carries signed `kv_transfer_params` saying
where they are (`do_remote_prefill`, `remote_host`, `remote_port`, `remote_block_hashes`, ...). A decode engine
(`--role decode`, kv_consumer) given those params fetches the blocks before the request is admitted (off the engine
thread, within a deadline) and enters them in its prefix cache, so the scheduler sees them as a cache hit and computes
only the rest (at least the last prompt token, whose logits it samples from). vLLM's proxies pass the same fields;
the router does it (sieve/router).

Trust (sieve/distributed/kv_auth.py): both ends hold one secret (`secret_file`). A decode server acts only on params a
prefill server signed, before they expire, once, and connects only to the producers it lists (`producers`); every
block carries a MAC over its bytes and its tokens. A client can neither point a decode server anywhere nor put bytes
in its prefix cache.

A block that is missing (lease expired, producer gone), fails its MAC, is of another layout or is late ends the
transfer there: the decode engine computes the rest itself. A transfer never produces a wrong token, only a slower one.

Transports (sieve/distributed/kv_store.py): `tcp` (the producer serves its blocks on a port; between hosts) and `shm`
(files in a private shared-memory directory; one host). The producer holds saved blocks under a lease (`lease_s`) and
a byte cap (`max_store_bytes`), and drops them when the lease ends or the consumer has taken them.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from sieve.distributed.kv_auth import MAC_BYTES, KVAuth, KVParamsError
from sieve.distributed.kv_store import BlockStore, KVTransferError, StoreFull, fetch_shm, fetch_tcp

log = logging.getLogger("sieve")

MAGIC = b"SVKV2"
MAX_HEADER = 4096
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both",
         "kv_producer": "kv_producer", "kv_consumer": "kv_consumer", "kv_both": "kv_both"}
__all__ = ["KVConnector", "KVFetch", "KVParamsError", "KVTransferConfig", "KVTransferError", "StoreFull"]


@dataclass
class KVTransferConfig:
    """vLLM's kv_transfer_config fields where they exist (kv_role, kv_ip, kv_port), plus the transport, the lease,
    the shared secret, the producers a consumer may fetch from, and the limits."""

    kv_role: str = "kv_both"  # kv_producer (prefill) | kv_consumer (decode) | kv_both
    transport: str = "tcp"  # tcp | shm
    kv_ip: str = "127.0.0.1"  # where this producer's KV port binds, exactly, and where consumers reach it
    kv_port: int = 0  # 0: any free port
    lease_s: float = 120.0  # how long saved blocks (and the params naming them) are held for a consumer
    shm_dir: str | None = None  # shm transport: a new directory for the blocks (default /dev/shm/sieve-kv-<random>)
    connect_timeout_s: float = 5.0
    secret_file: str | None = None  # the secret every prefill and decode server of a deployment shares (>= 16 bytes)
    producers: list = field(default_factory=list)  # a consumer fetches only from these: "host:port" (tcp), or shm dirs
    transfer_timeout_s: float = 10.0  # the whole of one request's transfer
    max_blocks_per_request: int = 4096
    max_store_bytes: int = 1 << 30  # a producer's exported blocks held at once; exports past it are refused

    _FIELDS = ("kv_role", "transport", "kv_ip", "kv_port", "lease_s", "shm_dir", "connect_timeout_s", "kv_connector",
               "secret_file", "producers", "transfer_timeout_s", "max_blocks_per_request", "max_store_bytes")

    @classmethod
    def parse(cls, value, role: str | None = None) -> "KVTransferConfig":
        from sieve.config import ConfigError

        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"kv_transfer_config is not valid JSON: {e}") from None
        if not isinstance(value or {}, dict):
            raise ConfigError("kv_transfer_config must be a JSON object")
        value = dict(value or {})
        unknown = sorted(set(value) - set(cls._FIELDS))
        if unknown:
            raise ConfigError(f"kv_transfer_config: unknown field(s) {', '.join(unknown)} (known: {', '.join(cls._FIELDS)})")
        value.pop("kv_connector", None)  # any name: sieve has one connector
        if role is not None:
            value["kv_role"] = role
        try:
            cfg = cls(**value)
        except TypeError as e:
            raise ConfigError(f"kv_transfer_config: {e}") from None
        cfg._check(ConfigError)
        return cfg

    def _check(self, error) -> None:
        if self.kv_role not in ROLES:
            raise error(f"role must be prefill, decode or both (or vLLM's kv_producer, kv_consumer, kv_both), got {self.kv_role!r}")
        self.kv_role = ROLES[self.kv_role]
        if self.transport not in ("tcp", "shm"):
            raise error(f"kv_transfer_config transport must be tcp or shm, got {self.transport!r}")
        if isinstance(self.kv_port, bool) or not (isinstance(self.kv_port, int) and 0 <= self.kv_port < 65536):
            raise error(f"kv_port must be a port number, got {self.kv_port!r}")
        for name in ("lease_s", "connect_timeout_s", "transfer_timeout_s", "max_blocks_per_request", "max_store_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise error(f"kv_transfer_config {name} must be a number > 0, got {v!r}")
        if not isinstance(self.producers, list) or not all(isinstance(p, str) for p in self.producers):
            raise error('kv_transfer_config producers must be a list of "host:port" strings or shm directories')
        if not self.secret_file:
            raise error("kv_transfer_config needs secret_file: a file (mode 600) holding at least 16 random bytes that every "
                        "prefill and decode server shares, e.g. `head -c 32 /dev/urandom > kv.key && chmod 600 kv.key`")

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


# ---- one block on the wire ---------------------------------------------------------------------
def encode_block(auth: KVAuth, block_hash: str, token_ids: list[int], layout: str, parts: list[torch.Tensor]) -> bytes:
    """MAGIC, header length, JSON header (hash, layout, byte size of each part), the parts' bytes, then a MAC over all of
    it and the block's token ids (which stay here: the consumer has its own)."""
    raw = [p.contiguous().view(torch.uint8).reshape(-1).cpu().numpy().tobytes() for p in parts]
    header = json.dumps({"hash": block_hash, "layout": layout, "sizes": [len(r) for r in raw]}).encode()
    body = MAGIC + struct.pack(">I", len(header)) + header + b"".join(raw)
    return body + auth.block_mac(body, token_ids)


def fill_block(views: list[torch.Tensor], raw_parts: list[bytes]) -> None:
    """Write a checked block's parts (`decode_block`) into the pool's views of one block (`ModelRunner.block_tensors`:
    strided views, copied into in place)."""
    for dst, raw in zip(views, raw_parts):
        dst.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dst.dtype).reshape(dst.shape).to(dst.device))


def block_bytes(layout: str, parts: list[torch.Tensor]) -> int:
    """The most a block of this layout can be on the wire: what a consumer lets a producer announce."""
    return len(MAGIC) + 4 + MAX_HEADER + sum(p.numel() * p.element_size() for p in parts) + MAC_BYTES


def decode_block(auth: KVAuth, payload: bytes, layout: str, token_ids: list[int], parts: list[torch.Tensor]) -> list[bytes]:
    """The parts' bytes of a payload that checks out against this engine: its MAC over these tokens, same layout and sizes."""
    if len(payload) < len(MAGIC) + 4 + MAC_BYTES or not payload.startswith(MAGIC):
        raise KVTransferError("not a KV block")
    body, mac = payload[:-MAC_BYTES], payload[-MAC_BYTES:]
    if not auth.block_ok(body, token_ids, mac):
        raise KVTransferError("block MAC mismatch (other tokens, or not from a producer holding the secret)")
    n = struct.unpack(">I", body[len(MAGIC) : len(MAGIC) + 4])[0]
    start = len(MAGIC) + 4
    if n > MAX_HEADER:
        raise KVTransferError("block header too long")
    header = json.loads(body[start : start + n])
    if header.get("layout") != layout:
        raise KVTransferError("KV layout differs (another model, dtype, KV dtype or block size)")
    sizes = [p.numel() * p.element_size() for p in parts]
    if header.get("sizes") != sizes:
        raise KVTransferError("block sizes differ")
    out, at = [], start + n
    for size in sizes:
        out.append(body[at : at + size])
        at += size
    if at != len(body):
        raise KVTransferError("block length differs")
    return out


@dataclass
class KVFetch:
    """What a consumer fetched for one prompt, verified, before the engine takes it: the parts of each good leading
    block, and the tokens they cover."""

    blocks: list[list[bytes]] = field(default_factory=list)
    block_size: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


@dataclass
class TransferStats:
    """What /metrics reports: bytes, blocks and seconds per direction (save on a producer, load on a consumer),
    transfers that fell back to computing locally, and params or exports refused, by reason."""

    bytes: Counter = field(default_factory=Counter)
    blocks: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)


class KVConnector:
    """One engine's end of KV transfer. `runner` gives the pool's per-block tensors (`block_tensors`); `blocks` (the
    block manager) names blocks by chained hash and takes imported ones into its prefix cache.

    A consumer's transfer has two halves: `fetch` (verify the params, fetch and check the blocks; any thread, touches
    no engine state) and `admit` (the engine thread: enter the fetched blocks in the prefix cache)."""

    def __init__(self, cfg: KVTransferConfig, layout: str, runner, blocks, engine_id: str):
        from sieve.config import ConfigError

        self.cfg, self.layout, self.runner, self.blocks, self.engine_id = cfg, layout, runner, blocks, engine_id
        try:
            self.auth = KVAuth.from_file(cfg.secret_file, cfg.lease_s)
        except (OSError, ValueError) as e:
            raise ConfigError(f"kv_transfer_config secret_file: {e}") from None
        self.stats = TransferStats()
        self.max_block_bytes = block_bytes(layout, runner.block_tensors(0))
        try:
            self.store = BlockStore(cfg, self.auth) if cfg.produces else None
        except (OSError, ValueError) as e:
            raise ConfigError(f"KV transfer: {e}") from None
        self.producers = set(cfg.producers)
        if self.store is not None:
            if self.store.shm_dir is not None:
                self.producers.add(str(self.store.shm_dir))  # kv_both: its own blocks
            else:
                self.producers.add(f"{cfg.kv_ip}:{self.store.port}")
            where = f"{cfg.kv_ip}:{self.store.port}" if cfg.transport == "tcp" else str(self.store.shm_dir)
            log.info("KV transfer: %s, serving saved blocks over %s at %s (lease %g s, at most %d MiB)", cfg.kv_role,
                     cfg.transport, where, cfg.lease_s, cfg.max_store_bytes >> 20)
        else:
            log.info("KV transfer: %s, fetching from %s", cfg.kv_role, ", ".join(sorted(self.producers)) or "no producer")

    # ---- producer ------------------------------------------------------------------------------
    def check_export(self) -> None:
        """Before a request asking for export is admitted: the store must have room for a block (StoreFull otherwise)."""
        if not self.store.has_room(self.max_block_bytes):
            self.stats.refused["store_full"] += 1
            raise StoreFull(f"the KV store is full ({self.store.bytes_held >> 20} MiB held, max_store_bytes "
                            f"{self.cfg.max_store_bytes >> 20} MiB): retry once decode servers have taken their blocks")

    def save(self, seq) -> dict:
        """After `seq` (a finished prefill) ran: save its prompt's full blocks; the signed params a consumer needs."""
        started = time.perf_counter()
        bs = self.blocks.block_size
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        # the blocks a consumer can take: never the one holding the prompt's last token, which it computes itself for
        # the logits of its first sample (exported, that block was never fetched, and held for the whole lease)
        hashes = self.blocks.prompt_hashes(prompt[: len(prompt) - 1], seq.request.params.cache_salt)
        saved = []
        for j, h in enumerate(hashes[: self.cfg.max_blocks_per_request]):
            block = self.blocks.cached_block(h)
            if block is None:  # evicted already (or never cached): the consumer computes from here
                break
            payload = encode_block(self.auth, h.hex(), prompt[j * bs : (j + 1) * bs], self.layout, self.runner.block_tensors(block))
            try:
                self.store.put(h.hex(), payload)
            except StoreFull as e:  # the rest is computed by the consumer
                self.stats.refused["store_full"] += 1
                log.warning("KV transfer: %s; exported %d of %d blocks", e, len(saved), len(hashes))
                break
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
        return self.auth.sign(params)

    def release(self, params: dict) -> int:
        """A gateway gives back blocks no decode server will take (signed params this producer issued): how many."""
        body = self.auth.check(params)
        hashes = [h for h in body.get("remote_block_hashes") or [] if isinstance(h, str)]
        held = sum(self.store.get(h) is not None for h in hashes)
        self.store.release(hashes)
        return held

    # ---- consumer ------------------------------------------------------------------------------
    def verify(self, params: dict) -> dict:
        """Remote-prefill params this consumer may act on (KVParamsError otherwise): signed with the secret, not expired,
        not used before, from a listed producer, naming no more blocks than allowed."""
        try:
            body = self.auth.check(params)
        except KVParamsError as e:
            self.stats.refused[str(e).split(":")[0]] += 1
            raise
        where = (f"{body.get('remote_host')}:{body.get('remote_port')}" if body.get("transport") == "tcp"
                 else str(body.get("remote_shm_dir")))
        if where not in self.producers:
            self.stats.refused["unlisted producer"] += 1
            raise KVParamsError(f"kv_transfer_params name a producer ({where}) this server does not list in "
                                "kv_transfer_config.producers")
        hashes = body.get("remote_block_hashes")
        if not isinstance(hashes, list) or len(hashes) > self.cfg.max_blocks_per_request:
            self.stats.refused["too many blocks"] += 1
            raise KVParamsError(f"kv_transfer_params name more than {self.cfg.max_blocks_per_request} blocks (max_blocks_per_request)")
        return body

    def fetch(self, token_ids: list[int], params: dict) -> KVFetch:
        """Verify `params` (KVParamsError), then fetch and check the blocks of `token_ids` they name. Any other failure
        cuts the fetch short and is counted: never raised, the rest is computed here."""
        body = self.verify(params)
        started = time.perf_counter()
        bs = self.blocks.block_size
        fetched = KVFetch(block_size=bs)
        try:
            if body.get("kv_layout") not in (None, self.layout):
                raise KVTransferError("KV layout differs (another model, dtype, KV dtype or block size)")
            hashes = [str(h) for h in body.get("remote_block_hashes") or []]
            if not all(len(h) == 32 and all(c in "0123456789abcdef" for c in h) for h in hashes):  # names, never paths
                raise KVTransferError("remote_block_hashes are not block hashes")
            # never the whole prompt: its last token is computed here, for the logits the first sample needs
            hashes = hashes[: (len(token_ids) - 1) // bs]
            if not hashes:
                return fetched
            if body.get("transport") == "shm":
                payloads = fetch_shm(str(body["remote_shm_dir"]), hashes, self.max_block_bytes, self.cfg)
            else:
                payloads = fetch_tcp(str(body["remote_host"]), int(body["remote_port"]), hashes, self.auth, self.max_block_bytes, self.cfg)
            probe = self.runner.block_tensors(0)
            for j, payload in enumerate(payloads):
                if payload is None:
                    raise KVTransferError("missing block")
                fetched.blocks.append(decode_block(self.auth, payload, self.layout, token_ids[j * bs : (j + 1) * bs], probe))
                self.stats.bytes["load"] += len(payload)
        except KVTransferError as e:
            self._fallback(str(e), None)
        except Exception as e:  # noqa: BLE001 (a broken peer must cost a recomputed prompt, never the request)
            self._fallback(type(e).__name__, e)
        finally:
            self.stats.seconds["load"] += time.perf_counter() - started
        return fetched

    def admit(self, token_ids: list[int], fetched: KVFetch, salt: str | None = None) -> int:
        """The engine thread: enter fetched blocks in the prefix cache. Returns the prompt tokens they cover."""
        mine = self.blocks.prompt_hashes(token_ids, salt)[: len(fetched.blocks)]
        for j, block in self.blocks.import_cached(mine):
            fill_block(self.runner.block_tensors(block), fetched.blocks[j])
        self.stats.blocks["load"] += len(mine)
        return len(mine) * fetched.block_size

    def _fallback(self, reason: str, error: Exception | None) -> None:
        self.stats.fallbacks[reason] += 1
        log.warning("KV transfer: %s%s; computing the rest of the prompt here", reason, f" ({error})" if error else "")

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def build_kv_connector(config, ckpt, arch, dtype, runner, block_manager) -> KVConnector:
    """An engine's end of KV transfer (prefill/decode disaggregation), checked against what it can move: one pool of
    full-attention blocks, found through the prefix cache."""
    import uuid

    from sieve.config import ConfigError
    from sieve.kv_fingerprint import kv_layout

    cfg = KVTransferConfig.parse(config.kv_transfer_config, config.kv_role)
    if len(runner.layer_groups) > 1 or arch.mamba_layers:
        raise ConfigError("KV transfer moves one pool of full-attention blocks: not built for sliding-window or Mamba-2 layers")
    if not config.enable_prefix_caching:
        raise ConfigError("KV transfer enters and finds blocks through the prefix cache: it needs prefix caching on")
    # Both ends must hold the same bytes for the same tokens: the model (its config and the size of its weight
    # files), the dtypes, the block size and the pool's shape. Paths may differ between hosts; contents may not.
    layout = kv_layout(ckpt.path, ckpt.config, dtype, runner.kv_dtype, runner.kv_pool.shape)
    return KVConnector(cfg, layout, runner, block_manager, uuid.uuid4().hex[:12])
