"""int4 weights against int8 activations (`activation_quantization="int8"`), in PyTorch: the arithmetic that
sieve/kernels/qmatmul_q8act.cpp runs on CPU, written out as the reference its tests check and as a path any
device can run.

Each input row is quantized per block of 32 inputs b, as llama.cpp's Q8 activations:
    d_b = max|x| * (1/127),  q = round-half-even(x * (1 / d_b)) in [-127, 127],  xs_b = sum of x (float32)
and an output is sum over b of  s * d_b * sum_k(w_k q_k) + m * xs_b,  with w_k the weight's codes 0..15 and
s, m the scale and min of the weight group holding b (Q4_0: m = -8 s). The integer sums are exact; the rest is
float32 in another order than the kernel's, so the two agree to rounding, not bit for bit.
"""

from __future__ import annotations

import torch

from sieve.quant.formats import Int4Weight

QBLOCK = 32  # inputs per activation scale
INV_127 = torch.tensor(1 / 127, dtype=torch.float32).item()  # the float32 constant the kernel multiplies by


def quantize_rows(x: torch.Tensor, k_padded: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, Kp], d float32 [M, Kp/32], xs float32 [M, Kp/32]), inputs past K zero."""
    if k_padded % QBLOCK:
        raise ValueError(f"int8 activations take blocks of {QBLOCK} inputs; {k_padded} is not a multiple")
    x = torch.nn.functional.pad(x.float(), (0, k_padded - x.shape[1])).view(x.shape[0], -1, QBLOCK)
    d = x.abs().amax(-1) * INV_127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(x.shape[0], -1), d, x.sum(-1)


def int4_matmul(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] . W^T with activations quantized as above -> float32 [M, N]."""
    if w.group % QBLOCK:
        raise ValueError(f"int8 activations take weight groups of a multiple of {QBLOCK} inputs, got {w.group}")
    codes = w.values()  # [N, Kp]
    n, kp = codes.shape
    q, d, xs = quantize_rows(x, kp)
    nb = kp // QBLOCK
    isum = torch.einsum("mbk,nbk->mnb", q.view(-1, nb, QBLOCK).float(), codes.view(n, nb, QBLOCK).float())  # exact
    per_block = w.group // QBLOCK
    s = w.scale.float().repeat_interleave(per_block, dim=1)  # [N, nb]
    m = (-8 * w.scale.float() if w.min is None else w.min.float()).repeat_interleave(per_block, dim=1)
    y = (isum * (s[None] * d[:, None, :])).sum(-1) + (m[None] * xs[:, None, :]).sum(-1)
    return y if bias is None else y + bias.float()
