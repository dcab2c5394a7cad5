"""The KV memory hierarchy below the pool: prefix-cache blocks written down to slower tiers and found again when
the pool no longer holds them, after a restart too. The engine's one interface is `KVTiers` (sieve/kv_tiers/tiers.py);
`build_kv_tiers` makes it from the engine's config. Tiers, fastest first: host RAM (`--kv-offloading-size`,
sieve/kv_tiers/host.py), local disk (`--kv-cache-disk`, sieve/kv_tiers/disk.py), and Redis shared by replicas
(`--kv-cache-remote`, sieve/kv_tiers/redis_store.py).

Keys: a directory per KV fingerprint (sieve/kv_fingerprint.py: the model by content, dtypes, the pool's layout,
the FP8 scales), a file per chained block hash (the prefix cache's, rooted in that fingerprint). Blocks from
another model or layout are never looked at, let alone used. Each block is the KV transfer payload, with a MAC
(HMAC-SHA256 under the tier's secret) over its bytes and its tokens: a corrupt or forged block is never loaded.

Lossless by default: a loaded block holds the bytes the pool held, so outputs are those of recomputing. Opt-in lossy
(`--kv-tier-dtype int8`, sieve/kv_tiers/lossy.py): about twice the blocks in the same room, said in the log and in
`sieve:kv_tier_lossy`, under a fingerprint of its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from pathlib import Path

from sieve.kv_tiers.disk import DiskStore
from sieve.kv_tiers.host import HostStore
from sieve.kv_tiers.redis_store import RedisStore
from sieve.kv_tiers.tiers import KVTiers, TierFetch, TierStats

__all__ = ["DiskStore", "HostStore", "KVTiers", "RedisStore", "TierFetch", "TierStats", "build_kv_tiers", "tier_secret"]

SECRET_NAME = "secret"
log = logging.getLogger("sieve")


def tier_secret(root: Path | None, secret_file: str | None) -> bytes:
    """The operator's secret (`secret_file`, mode 600), or the one the tier keeps in its own directory, made the first
    time (mode 600 in a directory of mode 700): a restart finds the blocks it signed before."""
    from sieve.distributed.kv_auth import KVAuth

    if secret_file:
        KVAuth.from_file(secret_file, 1.0)  # its checks (a private regular file, long enough)
        return Path(secret_file).read_bytes().strip()
    path = root / SECRET_NAME
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())
    KVAuth.from_file(str(path), 1.0)
    return path.read_bytes().strip()


def build_kv_tiers(config, layout: str, scales: str, arch, runner, block_manager, seconds_per_prefill_token: float) -> KVTiers:
    """The engine's tiers, checked against what they can hold: full-attention blocks (dense or latent) and, beside
    them, sliding-window layers' blocks, found through the prefix cache; not Mamba-2 state. `layout` and `scales`:
    sieve/kv_fingerprint.py."""
    from sieve.config import ConfigError
    from sieve.distributed.kv_auth import KVAuth

    if arch.mamba_layers:
        raise ConfigError("the KV tiers: a Mamba-2 layer's state is not kept in blocks, so a prefix cannot be restored from "
                          "them (serve without --kv-offloading-size / --kv-cache-disk / --kv-cache-remote)")
    lossy = config.kv_tier_dtype != "auto"
    # lossy blocks live under a fingerprint of their own: never mixed with a lossless tier's (a restart, a replica)
    wire_layout = f"{layout}|{scales}" + ("|window" if len(runner.layer_groups) > 1 else "") + (
        f"|tier:{config.kv_tier_dtype}" if lossy else "")
    fingerprint = hashlib.blake2b(wire_layout.encode(), digest_size=12).hexdigest()
    stores: list = [HostStore(int(config.kv_offloading_size * 1e9))] if config.kv_offloading_size else []
    try:
        if config.kv_cache_disk is not None:
            root = Path(config.kv_cache_disk)
            stores.append(DiskStore(root, fingerprint, int(config.kv_cache_disk_gb * 1e9),
                                    float(os.environ.get("SIEVE_KV_TIER_READ_DELAY_S", 0) or 0)))
            secret = tier_secret(root, config.kv_cache_secret_file)
        elif config.kv_cache_secret_file is not None or config.kv_cache_remote is not None:
            secret = tier_secret(None, config.kv_cache_secret_file)
        else:  # host RAM alone: this process's blocks, checked under a secret of its own, gone when it ends
            secret = secrets.token_hex(32).encode()
        if config.kv_cache_remote is not None:
            stores.append(RedisStore(config.kv_cache_remote, fingerprint))
        auth = KVAuth(secret, 1.0)
    except (OSError, ValueError) as e:
        raise ConfigError(f"the KV tiers: {e}") from None
    block_manager.new_cached = []
    if lossy:
        log.warning("KV tiers: lossy (--kv-tier-dtype %s): blocks are held as int8 codes with a scale per token and head, "
                    "and a loaded block is not the bytes the pool held: outputs may differ from recomputing", config.kv_tier_dtype)
    tiers = KVTiers(stores, auth, wire_layout, runner, block_manager, lossy=lossy)
    tiers.calibrate(seconds_per_prefill_token)
    return tiers
