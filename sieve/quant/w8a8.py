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

Kernels: on a CPU whose native build has AVX512-VNNI or AVX2, sieve's own (sieve/kernels/w8a8.cpp: vpdpbusd, or
AVX2's vpmaddubsw with llama.cpp's sign trick, on a blocked copy of the codes, `block_w8a8`; where the CPU has
AMX-INT8 tiles, calls of 8 rows and more multiply on them, tdpbusd, the same integer sums), a `NativeLinear` the
native layer loop calls too. On CUDA `torch._int_mm` (the int8 tensor cores, rows padded to what that kernel takes);
in a generic CPU build a float64 GEMM of the codes, exact and much slower than a bf16 one (the kernel's name in the
load log says which). Every kernel gives the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sieve.quant.formats import ChannelScaledWeight


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (int8 codes [T, K], float32 scales [T]): symmetric, per token, as the module docstring says."""
    x = x.to(torch.float32)
    amax = x.abs().amax(dim=1)
    # a true division (`127.0 / tensor` is torch's reciprocal times 127: two roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv[:, None]).clamp(-127, 127).to(torch.int8)
    return q, amax / 127.0


def int8_matmul(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact int32 products [T, N] of int8 q [T, K] and int8 w [N, K]. CUDA's int8 kernel wants more than 16 rows
    and sizes in multiples of 8: rows are padded (zeros add nothing), the sizes checked at load.

    On a CPU, not torch._int_mm: where the CPU has no VNNI, oneDNN's int8 GEMM multiplies with vpmaddubsw, whose
    int16 pair sums saturate, and its sums come out wrong (by up to ~2e4 on random codes under
    ONEDNN_MAX_CPU_ISA=AVX2, what a Zen 3 runs; tests/test_isa.py). float64 holds every product and every partial
    sum exactly (|sum| <= 127^2 K < 2^53), so its GEMM gives the exact sums in any order."""
    if q.device.type == "cuda":
        t = q.shape[0]
        pad = max(17, -(-t // 8) * 8) - t
        return torch._int_mm(F.pad(q, (0, 0, 0, pad)), w.t())[:t]
    return (q.double() @ w.double().t()).to(torch.int32)


def block_w8a8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [N, K] -> (int8 [N/16, K/4, 64]: for each 16 rows and quad u of inputs, row r's w[4u .. 4u + 3] at
    bytes 4r .. 4r + 3; int32 [N/16 * 16]: 128 x each row's sum), rows and inputs zero-padded (w8a8.cpp)."""
    n, k = q.shape
    v = F.pad(q, (0, -k % 4, 0, -n % 16))
    nb, k4 = v.shape[0] // 16, v.shape[1] // 4
    blocked = v.view(nb, 16, k4, 4).permute(0, 2, 1, 3).reshape(nb, k4, 64).contiguous()
    return blocked, (128 * v.to(torch.int32).sum(dim=1)).to(torch.int32)


def native_w8a8_ops(device: torch.device, dtype: torch.dtype):
    """sieve's CPU kernels where they multiply W8A8 (an AVX512-VNNI or AVX2 build, bf16 or float32 activations), else
    None."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return None
    from sieve.kernels import cpu_ops

    ops = cpu_ops()
    return ops if ops is not None and hasattr(ops, "w8a8_native") and ops.w8a8_native() else None


class W8A8Kernel:
    """`kernel(x)` for a W8A8 weight: quantize x per token, integer products, both scales (module docstring)."""

    widens = False

    def __init__(self, w: ChannelScaledWeight, dtype: torch.dtype, bias: torch.Tensor | None = None):
        if w.kind != "int8" or w.scale.dim() != 1:
            raise ValueError(f"W8A8 takes int8 weights with a scale per output channel, got {w.describe()}")
        n, k = w.q.shape
        if w.q.device.type == "cuda" and (n % 8 or k % 8):
            raise ValueError(f"W8A8 on CUDA multiplies with torch._int_mm, which takes sizes in multiples of 8, got {n}x{k}")
        self.dtype, self.n, self.k = dtype, n, k
        self.scale = w.scale.to(torch.float32)
        self.bias = None if bias is None else bias.to(torch.float32)
        self.nbytes = w.nbytes
        self.native = None
        ops = native_w8a8_ops(w.q.device, dtype)
        if ops is not None:  # the blocked copy replaces the plain codes
            blocked, comp = block_w8a8(w.q)
            scale = F.pad(self.scale, (0, comp.numel() - n))
            self.native = ops.NativeLinear(ops.LINEAR_W8A8, blocked, None, scale, comp, False, 0, n, k, bias)
            self.q = None
            self.name = f"{w.describe()} ({ops.isa} kernel, {ops.w8a8_kernel()})"
        else:
            self.q = w.q.contiguous()
            where = "torch._int_mm, int8 tensor cores" if w.q.device.type == "cuda" else "no int8 kernel in this CPU build: exact float64 products"
            self.name = f"{w.describe()} ({where})"

    def codes(self) -> ChannelScaledWeight:
        """The weight as this kernel holds it (the native kernel's blocked copy, unblocked)."""
        if self.native is None:
            return ChannelScaledWeight(self.q, self.scale, "int8")
        b = self.native.weight
        q = b.view(b.shape[0], b.shape[1], 16, 4).permute(0, 2, 1, 3).reshape(b.shape[0] * 16, b.shape[1] * 4)
        return ChannelScaledWeight(q[: self.n, : self.k].contiguous(), self.scale, "int8")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.native is not None:
            return self.native(x)
        q, s = quantize_tokens(x)
        y = int8_matmul(q, self.q).to(torch.float32) * s[:, None] * self.scale[None, :]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)
