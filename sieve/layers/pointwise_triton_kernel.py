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


@triton.jit
def rotary_write_kv(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, s_qkv, s_qt, s_qh, s_cos,
                    s_ks, s_kh, s_vs, s_vh, H, KVH, HALF: tl.constexpr, HP: tl.constexpr):
    """Program (t, j): head j of row t's q | k | v. A q head rotated into q; a k head rotated into its cache slot; a v
    head copied there. Rotate-half form, rounded where PyTorch's `x * cos + roll(x) * signed_sin` rounds (each product,
    then the sum; launched without FMA contraction)."""
    t, j = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, HP)
    mask = d < HALF
    src = qkv_ptr + t * s_qkv + j * (2 * HALF)
    x1 = tl.load(src + d, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + d, mask=mask, other=0.0)
    if j >= H + KVH:  # v: copied to its slot
        slot = tl.load(slot_ptr + t)
        dst = v_ptr + slot * s_vs + (j - H - KVH) * s_vh
        tl.store(dst + d, x1.to(v_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + d, x2.to(v_ptr.dtype.element_ty), mask=mask)
    else:
        pos = tl.load(pos_ptr + t)
        c = tl.load(cos_ptr + pos * s_cos + d, mask=mask, other=0.0).to(x1.dtype).to(tl.float32)  # the table in x's dtype
        s = tl.load(sin_ptr + pos * s_cos + d, mask=mask, other=0.0).to(x1.dtype).to(tl.float32)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        y1 = ((a1 * c).to(x1.dtype).to(tl.float32) - (a2 * s).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        y2 = ((a2 * c).to(x1.dtype).to(tl.float32) + (a1 * s).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        if j < H:
            dst = q_ptr + t * s_qt + j * s_qh
            tl.store(dst + d, y1, mask=mask)
            tl.store(dst + HALF + d, y2, mask=mask)
        else:
            slot = tl.load(slot_ptr + t)
            dst = k_ptr + slot * s_ks + (j - H) * s_kh
            tl.store(dst + d, y1.to(k_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + HALF + d, y2.to(k_ptr.dtype.element_ty), mask=mask)
