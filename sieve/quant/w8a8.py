"""W8A8: int8 weights (a scale per output channel) against int8 activations quantized per token on every call,
multiplied as integers (SmoothQuant, arXiv 2211.10438; llm-compressor's W8A8 "int-quantized" checkpoints).

The arithmetic, which every kernel computes (the integer sums are exact, so the result does not depend on the
batch or on the kernel that ran it):

    per row t of x [T, K]:   a_t = max_k |x_tk| (float32),  s_t = a_t / 127,  r_t = 127 / a_t  (0 where a_t = 0)
                             q_tk = round-half-even(x_tk * r_t) in [-127, 127]
    per output n:            acc_tn = sum_k q_tk * w_nk  (int32, exact)
                             y_tn = (float(acc_tn) * s_t) * c_n  (+ bias_n),  c_n the weight's channel scale

Dynamic per-token scales are what keep the activations' outliers from wrecking the other tokens (per-tensor static
scales took Llama-2's perplexity from 6.37 to ~15.7 in vLLM's PR #1112 thread); SmoothQuant's smoothing moves the
outlier channels' range into the weights beforehand (sieve/quant/smoothquant.py).

The reference here multiplies with `torch._int_mm` (CPU and CUDA). On CUDA that is the int8 tensor cores (rows
padded to what the kernel takes); on a CPU it is PyTorch's generic loop, ~10x slower than a bf16 GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sieve.quant.formats import ChannelScaledWeight


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (int8 codes [T, K], float32 scales [T]): symmetric, per token, as the module docstring says."""
    x = x.to(torch.float32)
    amax = x.abs().amax(dim=1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(x * inv[:, None]).clamp(-127, 127).to(torch.int8)
    return q, amax / 127.0


def int8_matmul(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact int32 products [T, N] of int8 q [T, K] and int8 w [N, K]. CUDA's int8 kernel wants more than 16 rows
    and sizes in multiples of 8: rows are padded (zeros add nothing), the sizes checked at load."""
    if q.device.type == "cuda":
        t = q.shape[0]
        pad = max(17, -(-t // 8) * 8) - t
        return torch._int_mm(F.pad(q, (0, 0, 0, pad)), w.t())[:t]
    return torch._int_mm(q, w.t())


class W8A8Kernel:
    """`kernel(x)` for a W8A8 weight: quantize x per token, integer products, both scales (module docstring)."""

    widens = False

    def __init__(self, w: ChannelScaledWeight, dtype: torch.dtype, bias: torch.Tensor | None = None):
        if w.kind != "int8" or w.scale.dim() != 1:
            raise ValueError(f"W8A8 takes int8 weights with a scale per output channel, got {w.describe()}")
        n, k = w.q.shape
        if w.q.device.type == "cuda" and (n % 8 or k % 8):
            raise ValueError(f"W8A8 on CUDA multiplies with torch._int_mm, which takes sizes in multiples of 8, got {n}x{k}")
        self.w, self.dtype = w, dtype
        self.q = w.q.contiguous()
        self.scale = w.scale.to(torch.float32)
        self.bias = None if bias is None else bias.to(torch.float32)
        self.nbytes = w.nbytes
        self.name = f"{w.describe()} (torch._int_mm)"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        q, s = quantize_tokens(x)
        y = int8_matmul(q, self.q).to(torch.float32) * s[:, None] * self.scale[None, :]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)
