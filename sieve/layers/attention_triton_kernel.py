"""The Triton kernel behind sieve/layers/attention_triton.py (imported on first use there: a CPU process
never pays for importing triton; Triton reads TRITON_INTERPRET when this module is imported)."""

import triton
import triton.language as tl

# A row's bits must not depend on the call it is in: one compiled kernel for every batch. Triton compiles a variant
# per value class of each integer argument (1, multiples of 16) and per 16-byte alignment of each pointer, and
# variants may lay out the sums otherwise (seen on an H200: a 16-key row alone and in a batch differed in its last
# bits when the loop's bound, the table's width, was a compile-time constant). So nothing is specialized, and each
# row walks its own blocks in a while loop bounded by its own length (which Triton's CPU interpreter runs too).
_INTS = ["s_qt", "s_qh", "s_kb", "s_ks", "s_kh", "s_vb", "s_vs", "s_vh", "s_tt", "s_ot", "s_oh"]
_PTRS = ["q_ptr", "k_ptr", "v_ptr", "tab_ptr", "len_ptr", "first_ptr", "out_ptr"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_PTRS)
def paged_decode(q_ptr, k_ptr, v_ptr, tab_ptr, len_ptr, first_ptr, out_ptr, scale,
                  s_qt, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_tt, s_ot, s_oh,
                  GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                  HAS_FIRST: tl.constexpr):
    row, kvh = tl.program_id(0), tl.program_id(1)
    ctx = tl.load(len_ptr + row)
    first = tl.load(first_ptr + row) if HAS_FIRST else 0
    g, d, s = tl.arange(0, GP), tl.arange(0, DP), tl.arange(0, BS)
    heads = kvh * GROUP + g
    qmask = (g < GROUP)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + row * s_qt + heads[:, None] * s_qh + d[None, :], mask=qmask, other=0.0).to(tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    b = first // BS  # the row's blocks from the first holding a visible key (so the max is finite after it), in order
    while b * BS < ctx:
        blk = tl.load(tab_ptr + row * s_tt + b)
        pos = b * BS + s
        valid = (pos < ctx) & (pos >= first)
        kvmask = valid[:, None] & (d < D)[None, :]
        k = tl.load(k_ptr + blk * s_kb + s[:, None] * s_ks + kvh * s_kh + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BS]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + blk * s_vb + s[:, None] * s_vs + kvh * s_vh + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
        b += 1
    out = acc / l_i[:, None]
    tl.store(out_ptr + row * s_ot + heads[:, None] * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=qmask)
