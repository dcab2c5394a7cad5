"""The Triton kernels behind sieve/layers/pointwise_triton.py (imported on first use there: a CPU process never pays
for importing triton; Triton reads TRITON_INTERPRET when this module is imported). One program per row (and column
block): a row's result depends on that row alone, at every row count."""

import triton
import triton.language as tl


@triton.jit
def add_rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, total_ptr, eps, H, s_x, s_r, s_o, s_t,
                 HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    if HAS_RES:  # the residual add rounded to the stream's dtype, where `x + residual` rounds (in float32 first: as
        # PyTorch adds 16-bit values, and Triton's interpreter adds bfloat16 wrongly)
        x = (xf + tl.load(res_ptr + row * s_r + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(total_ptr + row * s_t + cols, x, mask=mask)
        xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # normalised and rounded, then scaled and rounded: products of two 16-bit values are exact in float32, so this is
    # PyTorch's 16-bit multiply (and Triton's interpreter multiplies bfloat16 wrongly)
    tl.store(out_ptr + row * s_o + cols, ((xf * inv).to(x.dtype).to(tl.float32) * w).to(x.dtype), mask=mask)


@triton.jit
def silu_mul(gu_ptr, out_ptr, inter, s_in, s_out, BLOCK: tl.constexpr):
    row, blk = tl.program_id(0), tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    up = tl.load(gu_ptr + row * s_in + inter + cols, mask=mask, other=0.0)
    g = tl.load(gu_ptr + row * s_in + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(up.dtype).to(tl.float32)  # silu in float32, rounded as F.silu's output is
    tl.store(out_ptr + row * s_out + cols, (act * up.to(tl.float32)).to(up.dtype), mask=mask)  # (as in add_rms_norm)
