"""ChunkKV (Liu et al., 2025): a scorer's per-position scores (summed over KV heads) averaged per chunk of
`chunk` consecutive positions; whole chunks are kept, best first, so a kept fact keeps its neighbours. The chosen
positions are shared by every KV head and reused by the next `reuse - 1` layers (the paper's layer-wise index reuse:
neighbouring layers keep much the same chunks, and scoring is skipped for them).

Every layer keeps exactly n_kept positions (one slot count per sequence): the chunks are taken best first until one
would overflow, and that last chunk gives its best-scoring positions. The partial tail chunk competes on its mean,
as in kvpress's ChunkKVPress (which can keep a different count per layer; this one cannot)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sieve.kv_compression.press import LayerKV, Press
from sieve.kv_compression.snapkv import SnapKVPress


@dataclass
class ChunkKVPress(Press):
    name = "chunkkv"
    question_aware = True
    scorer: Press = field(default_factory=SnapKVPress)
    chunk: int = 20
    reuse: int = 2
    _kept: torch.Tensor | None = field(default=None, repr=False)
    _age: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self.query_window = self.scorer.query_window
        self.question_aware = self.scorer.question_aware

    def min_prompt(self) -> int:
        return self.scorer.min_prompt()

    def keep(self, kv: LayerKV, n_kept: int) -> torch.Tensor:
        if self._kept is not None and self._age < self.reuse:
            self._age += 1
            return self._kept
        scores = self.scorer.score(kv).sum(dim=0)  # [T]
        T = scores.shape[0]
        starts = torch.arange(0, T, self.chunk, device=scores.device)
        means = torch.stack([scores[s: s + self.chunk].mean() for s in starts.tolist()])
        picked: list[torch.Tensor] = []
        left = n_kept
        for c in means.argsort(descending=True, stable=True).tolist():
            s = c * self.chunk
            positions = torch.arange(s, min(s + self.chunk, T), device=scores.device)
            if len(positions) > left:
                positions = positions[scores[positions].topk(left).indices]
            picked.append(positions)
            left -= len(positions)
            if left == 0:
                break
        kept = torch.cat(picked).sort().values.expand(kv.keys.shape[0], -1)
        self._kept, self._age = kept, 1
        return kept
