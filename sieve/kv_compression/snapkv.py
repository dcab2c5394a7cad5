"""SnapKV (Li et al., 2024): the attention the prompt's last `window` queries (the observation window, normally the
question) pay each earlier position, averaged over the window and the KV head's query heads and smoothed by a
`kernel`-wide average pool; the window itself is always kept. Question-aware: a prefix compressed this way serves
only the question it was compressed for. The same positions as kvpress's SnapKVPress."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sieve.kv_compression.press import LayerKV, Press


def window_attention(kv: LayerKV, own_columns: bool = False) -> torch.Tensor:
    """[H, w, T - w]: the softmax attention of the last w queries over the prompt's keys (causal inside the window),
    the window's own columns dropped ([H, w, T] with `own_columns`)."""
    q, k = kv.queries, kv.keys
    H, w, _ = q.shape
    KVH, T, _ = k.shape
    k = k.repeat_interleave(H // KVH, dim=0)  # [H, T, D]
    logits = torch.matmul(q, k.transpose(1, 2)) * kv.scale  # [H, w, T]
    causal = torch.ones(w, T, dtype=torch.bool, device=q.device).triu(T - w + 1)
    logits = logits.masked_fill(causal, float("-inf"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return probs if own_columns else probs[..., : T - w]


@dataclass
class SnapKVPress(Press):
    name = "snapkv"
    question_aware = True
    query_window: int = 64
    kernel: int = 5

    def score(self, kv: LayerKV) -> torch.Tensor:
        KVH, T, _ = kv.keys.shape
        H = kv.queries.shape[0]
        scores = window_attention(kv).mean(dim=-2)  # [H, T - w]
        scores = F.avg_pool1d(scores, kernel_size=self.kernel, padding=self.kernel // 2, stride=1)
        scores = scores.view(KVH, H // KVH, -1).mean(dim=1)
        return F.pad(scores, (0, self.query_window), value=scores.max().item())
