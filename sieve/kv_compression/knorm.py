"""Key norm (Devoto et al., 2024): keys with a small L2 norm draw the most attention; keep the smallest.
Question-agnostic, and needs nothing but the cached keys. The same positions as kvpress's KnormPress."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sieve.kv_compression.press import LayerKV, Press


@dataclass
class KnormPress(Press):
    name = "knorm"

    def min_prompt(self) -> int:
        return 1

    def score(self, kv: LayerKV) -> torch.Tensor:
        return -kv.keys.norm(dim=-1)
