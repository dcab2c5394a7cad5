"""Quantized weights on CUDA without widening them: one Triton GEMM that dequantizes tiles of int8 or
int4 weights in registers, inside the product, for any batch.

    y [M, N] = x [M, K] . W^T + bias,   W decoded per tile:
        int8  w = q * s[n]          (per-channel float32 scale)    or q * s[n, k // group] (GGUF Q8_0)
        int4  w = q * s[n, g] + m[n, g]   (Q4_1, zero-point int4, AWQ)   or (q - 8) * s[n, g] (Q4_0)
              q packed two per byte, low nibble first, [N, K / 2]

Each program computes a BLOCK_M x BLOCK_N tile of y, walking K in BLOCK_K steps: it loads the codes
of a BLOCK_N x BLOCK_K tile contiguously (int4: BLOCK_K / 2 bytes a row, the two nibbles joined back
into input order), the tile's scales (and mins) once per row and group, broadcast over the group by
a reshape, dequantizes to the activation dtype and runs `tl.dot` with float32 accumulation. (A first
version gathered a scale and a byte per element: 37-45 GB/s for int4 on an H100.) Bytes read per call are the weight's stored bytes (plus x), so a decode
step reads what the format holds, not a widened copy (the path this replaces dequantized the whole
matrix on every call). fp8 keeps `_scaled_mm` on GPUs with FP8 tensor cores (sieve/quant/kernels.py).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: make_kernel never asks for these
    triton = None


if triton is not None:

    # M (the rows) is not specialized: Triton would compile M == 1 apart, and a variant may order a row's sums
    # otherwise. With one tile shape for every row count (TritonKernel.__call__), every M runs one compiled
    # kernel, and a decode row, the same row among a verification's drafted rows and among a prefill chunk's
    # rows get the same bits (sieve/layers/attention_triton_kernel.py, the same rule).
    @triton.jit(do_not_specialize=["M"])
    def _qlinear(x_ptr, q_ptr, s_ptr, m_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_q, stride_s, stride_ym,
                 GROUP: tl.constexpr, INT4: tl.constexpr, GROUPED: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        nmask = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
            if INT4:  # BLOCK_K / 2 bytes of each row, contiguous; nibbles interleaved back into input order
                kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                byte = tl.load(q_ptr + rn[:, None] * stride_q + kb[None, :], mask=nmask[:, None] & (kb[None, :] < K // 2), other=0)
                byte = byte.to(tl.int32)
                q = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BLOCK_N, BLOCK_K)).to(tl.float32)
            else:
                q = tl.load(q_ptr + rn[:, None] * stride_q + k[None, :], mask=nmask[:, None] & (k[None, :] < K), other=0).to(tl.float32)
            if GROUPED:
                if GROUP >= BLOCK_K:  # one scale (and min) per row for the whole tile
                    g = k0 // GROUP
                    s = tl.load(s_ptr + rn * stride_s + g, mask=nmask, other=0.0).to(tl.float32)[:, None]
                    if HAS_MIN:
                        w = q * s + tl.load(m_ptr + rn * stride_s + g, mask=nmask, other=0.0).to(tl.float32)[:, None]
                    elif INT4:
                        w = (q - 8.0) * s
                    else:
                        w = q * s
                else:  # BLOCK_K // GROUP scales per row, each broadcast over its group
                    gi = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
                    gmask = nmask[:, None] & (gi[None, :] < (K + GROUP - 1) // GROUP)
                    s = tl.load(s_ptr + rn[:, None] * stride_s + gi[None, :], mask=gmask, other=0.0).to(tl.float32)
                    q3 = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP))
                    if HAS_MIN:
                        mn = tl.load(m_ptr + rn[:, None] * stride_s + gi[None, :], mask=gmask, other=0.0).to(tl.float32)
                        w3 = q3 * s[:, :, None] + mn[:, :, None]
                    elif INT4:
                        w3 = (q3 - 8.0) * s[:, :, None]
                    else:
                        w3 = q3 * s[:, :, None]
                    w = tl.reshape(w3, (BLOCK_N, BLOCK_K))
            else:
                w = q  # per-channel scale, applied to the sums
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        if not GROUPED:
            acc *= tl.load(s_ptr + rn, mask=nmask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & nmask[None, :])


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return triton is not None and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


class TritonKernel:
    """int8 (per-channel or grouped) and int4 weights on CUDA, dequantized tile by tile inside the GEMM."""

    widens = False

    def __init__(self, w, dtype: torch.dtype, bias: torch.Tensor | None = None):
        from sieve.quant.formats import Int4Weight

        self.nbytes, self.dtype, self.bias = w.nbytes, dtype, bias
        self.int4 = isinstance(w, Int4Weight)
        self.name = f"{w.describe()} (Triton, dequantized per tile)"
        if self.int4:
            self.q, self.k, self.n = w.packed.contiguous(), w.k, w.packed.shape[0]
            self.scale, self.min, self.group, self.grouped = w.scale.contiguous(), w.min, w.group, True
            self.min = None if w.min is None else w.min.contiguous()
        else:
            self.q, (self.n, self.k) = w.q.contiguous(), w.q.shape
            self.grouped = w.scale.dim() == 2
            self.scale = w.scale.contiguous() if self.grouped else w.scale.to(torch.float32).contiguous()
            self.min, self.group = None, w.group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        M = x.shape[0]
        y = torch.empty(M, self.n, dtype=x.dtype, device=x.device)
        # One tile shape at every row count: a 64 x 128 tile above 16 rows (as before) takes other tensor-core
        # instructions, which sum a row's products in another order, so a drafted sequence's rows in a step of
        # 17 or more rows differed from its rows decoded alone (seen on an H200: bfloat16, ngram k = 6 with 4
        # branches, 28 rows a step, tokens not speculation-off's). Many rows re-read a weight tile once per 16
        # rows, from L2; prefill pays for that, decode does not.
        block_m, block_n = 16, 64
        block_k = 128 if not self.grouped or self.group >= 128 or 128 % self.group == 0 else self.group
        grid = (triton.cdiv(M, block_m), triton.cdiv(self.n, block_n))
        _qlinear[grid](x, self.q, self.scale, self.min if self.min is not None else self.scale,
                       self.bias if self.bias is not None else self.scale, y, M, self.n, self.k,
                       x.stride(0), self.q.stride(0), self.scale.stride(0) if self.grouped else 0, y.stride(0),
                       GROUP=self.group if self.grouped else 1, INT4=self.int4, GROUPED=self.grouped, HAS_MIN=self.min is not None,
                       HAS_BIAS=self.bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
        return y
