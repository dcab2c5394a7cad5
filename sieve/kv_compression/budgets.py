"""Entropy-guided budgets: each attention layer keeps a share of the prompt's total budget (L x n_kept positions for L
layers, what a uniform press keeps) in proportion to how spread out its attention is, so a layer whose queries look
at many positions keeps more of them and a layer that looks at few keeps fewer. The same bytes as the uniform press.

A layer's attention entropy is measured on calibration text where the engine has a profile (`--kv-budget-profile
FILE`: per-layer entropies, as `python scripts/attention_entropy.py --output-json FILE` writes them from WikiText
windows), the same shares for every prompt; else on the prompt itself: the softmax attention of its last `WINDOW`
queries (SnapKV's observation window) over every position, its entropy averaged over the window and the heads (then
the budgets, and so the press, depend on the prompt's end: question-aware). A layer's
share is counted in whole blocks (its kept positions fill whole blocks of the sequence's table, so later tokens
start on a block in every layer), at least one block and at most the prompt's whole blocks; the layers' blocks are
packed across the pool's layer planes (sieve/kv_compression/cells.py), so the sequence holds about L x n_kept
positions of KV, not as many as its largest layer keeps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from sieve.kv_compression.press import LayerKV
from sieve.kv_compression.snapkv import window_attention

WINDOW = 64  # queries whose attention measures a layer's entropy (where the press reads none of its own)


def attention_entropy(kv: LayerKV) -> float:
    """The mean entropy (nats) of the attention of `kv.queries` [H, w, D], the prompt's last w positions, over its
    keys (causal)."""
    p = window_attention(kv, own_columns=True)
    return float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())


def layer_blocks(entropies: list[float], n_kept: int, num_tokens: int, block_size: int) -> list[int]:
    """Blocks of kept positions per layer: the uniform budget (len(entropies) x n_kept positions, in whole blocks) in
    proportion to each layer's entropy, each layer at least 1 block and at most the prompt's whole blocks, the
    capped layers' excess shared among the others (water-filling), the rest of a block by largest remainder."""
    L = len(entropies)
    cap = max(1, num_tokens // block_size)
    total = min(L * cap, max(L, L * n_kept // block_size))
    weights = [max(e, 1e-6) for e in entropies]
    fixed: dict[int, int] = {}
    while True:  # layers whose share exceeds the cap take the cap; the rest share what is left
        free = [i for i in range(L) if i not in fixed]
        left = total - sum(fixed.values())
        mass = sum(weights[i] for i in free)
        over = [i for i in free if left * weights[i] / mass > cap]
        if not over:
            break
        fixed.update({i: cap for i in over})
    share = {i: left * weights[i] / mass for i in free}
    blocks = [fixed.get(i, max(1, math.floor(share.get(i, 0)))) for i in range(L)]
    by_remainder = sorted(free, key=lambda i: share[i] - math.floor(share[i]), reverse=True)
    for i in by_remainder:
        if sum(blocks) >= total:
            break
        if blocks[i] < cap:
            blocks[i] += 1
    return blocks


def load_profile(path: str) -> list[float]:
    """Per-layer attention entropies from a JSON file: a list of numbers, or an object whose "entropy_nats" is one
    (scripts/attention_entropy.py's output). ValueError naming the file when it is not that."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"kv_budget_profile {path!r}: not a readable JSON file ({e})") from None
    values = data.get("entropy_nats") if isinstance(data, dict) else data
    if not isinstance(values, list) or not values or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"kv_budget_profile {path!r}: want a list of positive per-layer entropies "
                         "(or an object with one as \"entropy_nats\")")
    return [float(v) for v in values]
