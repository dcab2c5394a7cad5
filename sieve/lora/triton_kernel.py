"""The Triton kernels behind sieve/lora/slots.py (imported on first use: a CPU process never pays for importing
triton; Triton reads TRITON_INTERPRET when this module is imported). Each program serves one row, whichever adapter
that row runs (its slot; -1: the base model alone), so one launch serves every adapter of a step, and a row's result
depends on that row alone."""

import triton
import triton.language as tl


@triton.jit
def shrink(x_ptr, a_ptr, t_ptr, slot_ptr, layer, IN, s_x, s_as, s_al, s_ak, R: tl.constexpr, RP: tl.constexpr,
           BK: tl.constexpr):
    """t[row] = x[row] A^T of the row's slot (float32 [R])."""
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    on = slot >= 0
    base = a_ptr + tl.maximum(slot, 0) * s_as + layer * s_al
    r = tl.arange(0, RP)
    acc = tl.zeros([RP], tl.float32)
    k0 = 0
    while k0 < IN:  # (a while loop: Triton's interpreter, which the CPU tests use, runs no range over an argument)
        k = k0 + tl.arange(0, BK)
        xk = tl.load(x_ptr + row * s_x + k, mask=(k < IN) & on, other=0.0).to(tl.float32)
        a = tl.load(base + k[:, None] * s_ak + r[None, :], mask=((k < IN)[:, None] & (r < R)[None, :]) & on, other=0.0)
        acc += tl.sum(xk[:, None] * a.to(tl.float32), axis=0)
        k0 += BK
    tl.store(t_ptr + row * RP + r, acc, mask=r < RP)


@triton.jit
def expand(t_ptr, b_ptr, y_ptr, slot_ptr, layer, OUT, s_y, s_bs, s_bl, s_br, R: tl.constexpr, RP: tl.constexpr,
           BN: tl.constexpr):
    """y[row, block] += t[row] B^T of the row's slot, rounded once to y's dtype."""
    row, blk = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ptr + row)
    on = slot >= 0
    base = b_ptr + tl.maximum(slot, 0) * s_bs + layer * s_bl
    r = tl.arange(0, RP)
    n = blk * BN + tl.arange(0, BN)
    tv = tl.load(t_ptr + row * RP + r)
    b = tl.load(base + r[:, None] * s_br + n[None, :], mask=((r < R)[:, None] & (n < OUT)[None, :]) & on, other=0.0)
    add = tl.sum(tv[:, None] * b.to(tl.float32), axis=0)
    out = y_ptr + row * s_y + n
    y = tl.load(out, mask=(n < OUT) & on, other=0.0)
    tl.store(out, (y.to(tl.float32) + add).to(y.dtype), mask=(n < OUT) & on)
