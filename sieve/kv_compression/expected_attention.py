"""Expected attention (Devoto et al., 2025): the attention a key can expect from the queries still to come, modelled
from the prompt's own queries. Their mean and covariance before rotation (every position but the sinks), rotated by
the average rotation of the next `n_future_positions` positions, give each key the expected score
exp(mu . k / sqrt(d) + k^T S k / (2 d)) of a Gaussian query; softmaxed over the prompt, averaged over the KV head's
query heads and weighted by the value's norm. The `n_sink` first positions are always kept. Question-agnostic (it
reads no particular query), so it suits a prompt shared by questions to come. The same positions as kvpress's
ExpectedAttentionPress.

The statistics are gathered during the prompt's own prefill (sieve/kv_compression/query_stats.py), not by a second
pass over it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sieve.kv_compression.press import LayerKV, Press


@dataclass
class ExpectedAttentionPress(Press):
    name = "expected_attention"
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        self.query_stats_from = self.n_sink
        self.future_positions = self.n_future_positions

    def min_prompt(self) -> int:
        return self.n_sink + 1

    def score(self, kv: LayerKV) -> torch.Tensor:
        s = self.n_sink
        keys, values = kv.keys[:, s:], kv.values[:, s:]  # [KVH, T - s, D]
        KVH, n, d = keys.shape
        R = kv.future_rotation
        mean = kv.query_mean @ R.T  # [H, D]
        H = mean.shape[0]
        k = keys.repeat_interleave(H // KVH, dim=0)  # [H, n, D]
        scores = torch.matmul(k, mean[:, :, None])[..., 0] / math.sqrt(d)  # [H, n]
        if self.use_covariance:
            cov = R @ kv.query_cov @ R.T  # [H, D, D]
            scores = scores + (torch.matmul(k, cov) * k).sum(dim=-1) / d / 2
        scores = F.softmax(scores, dim=-1).view(KVH, H // KVH, n).mean(dim=1)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * values.norm(dim=-1)
        return F.pad(scores, (s, 0), value=scores.max().item() + 1)
