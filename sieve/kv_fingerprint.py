"""What a KV block's bytes depend on, named once: the model (its config and its weight files' sizes, never their
path, so that replicas on other hosts and a restarted server agree), the dtype, the KV cache's dtype and the pool's
shape (layers, block size, heads, head size). The prefix cache roots its chained block hashes in it, KV transfer
checks a producer's layout against it, and the KV tiers (sieve/kv_tiers) key stored blocks by it, with the FP8 KV
scales on top where the engine calibrated them: the same codes under other scales are other values.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def kv_layout(ckpt_path, ckpt_config: dict, dtype, kv_dtype, pool_shape) -> str:
    """The layout string: `model id | dtype | KV dtype | pool shape without its block count`."""
    path = Path(ckpt_path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    weights = "|".join(f"{p.name}:{p.stat().st_size}" for p in files if p.suffix in (".safetensors", ".gguf", ".bin", ".pt"))
    model_id = hashlib.blake2b((json.dumps(ckpt_config, sort_keys=True, default=str) + weights).encode(), digest_size=8).hexdigest()
    shape = tuple(pool_shape[:2]) + tuple(pool_shape[3:])
    return f"{model_id}|{dtype}|{kv_dtype}|{shape}"


def kv_scales_digest(caches) -> str:
    """A digest of the KV layers' fixed per-layer scales (FP8), or '' where there are none."""
    values = []
    for c in caches:
        for name in ("k_scale", "v_scale"):
            t = getattr(c, name, None)
            if t is not None and getattr(t, "numel", lambda: 0)() == 1:
                values.append(float(t))
    return hashlib.blake2b(json.dumps(values).encode(), digest_size=8).hexdigest() if values else ""
