"""Linear layers. Quantization (a later feature) swaps this class at load time; model code never changes.

`Linear` may hold several checkpoint matrices stacked along the output dimension (q/k/v, gate/up)
so that one GEMM serves them all; `shard_sizes` says where each lands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.shard_sizes = list(shard_sizes)
        out_features = sum(shard_sizes)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        """Copy checkpoint tensor `name` ('weight' or 'bias') into output shard `shard`."""
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {name} this layer does not expect")
        start = sum(self.shard_sizes[:shard])
        rows = target.narrow(0, start, self.shard_sizes[shard])
        if rows.shape != tensor.shape:
            raise ValueError(f"shape mismatch loading {name}: checkpoint {tuple(tensor.shape)}, model {tuple(rows.shape)}")
        rows.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return F.linear(x, self.weight, self.bias)
