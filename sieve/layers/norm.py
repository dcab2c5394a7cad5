"""RMSNorm, with the residual add of a pre-norm decoder fused in (as vLLM does):
`norm(x)` -> normed x; `norm(x, residual)` -> (normed (x + residual), x + residual).

bf16 and float32 rows on CPU go through one native kernel (sieve/kernels/layer_ops.cpp), the one the C++ layer loop
runs, so that the Python loop gives that loop's bits (F.rms_norm sums the squares in another order: 1e-7 apart, which a
16-bit KV cache or the int4 kernels' bf16 inputs can round into other values); everything else through `F.rms_norm`,
which computes in float32 internally and matches the Hugging Face formula (cast to float32, normalise, cast back,
scale) in float32 and bfloat16. The native kernel rounds where that formula rounds; only the order of its float32 sum
of squares differs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sieve.kernels import cpu_ops
from sieve.layers import pointwise_triton


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dim() == 3 and residual is None:  # per-head norms (Qwen3 q/k): rows of head_dim, as the native loop does
            return self(x.reshape(-1, x.shape[-1])).view(x.shape)
        ops = _native(x) if self.weight.dtype == x.dtype else None
        if ops is not None and (residual is None or (_native(residual) is not None and residual.dtype == x.dtype)):
            out, total = ops.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, total)
        if self.weight.dtype == x.dtype and pointwise_triton.supports(x) and (residual is None or residual.shape == x.shape
                                                                          and residual.dtype == x.dtype):
            return pointwise_triton.add_rms_norm(x, residual, self.weight, self.eps)  # CUDA: one launch
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        total = x + residual
        return F.rms_norm(total, self.weight.shape, self.weight, self.eps), total


_MAX_NATIVE_WIDTH = 16384  # layer_ops.cpp kMaxNormWidth


def _native(x: torch.Tensor):
    """The native kernels if they take `x`: bf16 or float32 [T, H] on CPU with contiguous rows, outside autograd (they
    record no gradient)."""
    if (x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu" or x.dim() != 2 or x.stride(-1) != 1
            or x.shape[-1] > _MAX_NATIVE_WIDTH or x.requires_grad):
        return None
    return cpu_ops()
