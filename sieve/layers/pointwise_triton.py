"""A decoder layer's pointwise work on CUDA in one Triton launch each, where PyTorch takes several: the residual add
fused into the RMSNorm after it (add, square-mean, rsqrt, scale: one pass over the row), SiLU x mul over the fused
gate|up projection, and in a decode-only step rotary applied to q and k with k and v written to their cache slots. A small model's GPU decode step is launch-bound (issue 62), so a launch saved per layer is time
saved per step, captured or not.

Each program takes one row (RMSNorm) or one block of one row (SiLU x mul): a row's result never depends on how many
rows the call holds, so a padded CUDA-graph bucket gives its real rows the bits an unpadded step gives. Rounding
follows PyTorch's: the residual sum in the stream's dtype, the norm in float32 rounded before the weight multiplies it
(as `F.rms_norm`), SiLU in float32 rounded before the product (as `F.silu(gate) * up`), rotary's two products rounded
before their sum (launched without FMA contraction); only the order of the float32 sum of squares differs (tests/test_pointwise_triton.py: within an ulp of the PyTorch path). The CPU keeps its native
kernels (sieve/kernels/layer_ops.cpp). SIEVE_FUSED_POINTWISE=0 turns these off (the benchmark's comparison).
"""

from __future__ import annotations

import functools
import os

import torch

from sieve.layers.attention_triton import next_pow2


@functools.lru_cache(maxsize=None)
def _kernels():
    try:
        from sieve.layers import pointwise_triton_kernel
    except ImportError:
        return None
    return pointwise_triton_kernel


def supports(x: torch.Tensor) -> bool:
    """A float CUDA tensor of contiguous rows [T, H] (or any device under Triton's interpreter, which the CPU tests
    use), unless SIEVE_FUSED_POINTWISE=0."""
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if os.environ.get("SIEVE_FUSED_POINTWISE", "1") == "0" or x.requires_grad:
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.dim() != 2 or x.stride(-1) != 1:
        return False
    return _kernels() is not None



def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """RMSNorm(x + residual) * weight and x + residual ([T, H] each; residual None: the norm of x alone, and no sum)."""
    T, H = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else None
    if T:
        res = residual.contiguous() if residual is not None else x
        _kernels().add_rms_norm[(T,)](x, res, weight, out, total if total is not None else out, float(eps), H, x.stride(0),
                                      res.stride(0), out.stride(0), total.stride(0) if total is not None else 0,
                                      HAS_RES=residual is not None, BLOCK=next_pow2(H))
    return out if residual is None else (out, total)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = gate_up.new_empty(T, inter)
    block = min(1024, next_pow2(inter))
    if T:
        _kernels().silu_mul[(T, -(-inter // block))](gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out


def supports_rotary_write(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """`supports(qkv)`, and caches of floats whose slots are rows of one stride (a block's slots follow each other)."""
    return supports(qkv) and all(c.dtype in (torch.float32, torch.bfloat16, torch.float16) and c.stride(-1) == 1
                                 and c.stride(0) == c.shape[1] * c.stride(1) for c in (k_cache, v_cache))


def rotary_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                    num_kv_heads: int) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) * D] (q | k | v) -> the rotated queries [T, H, D]; each row's rotated keys and its values
    written to its slot of the caches [blocks, block_size, KVH, D]: rotary and the cache write in one launch, where
    PyTorch takes six (`apply_rotary`'s four, `write_kv`'s two)."""
    T = qkv.shape[0]
    D = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q = qkv.new_empty(T, num_heads, D)
    if T:
        _kernels().rotary_write_kv[(T, num_heads + 2 * num_kv_heads)](
            qkv, positions, cos_table, sin_table, q, k_cache, v_cache, slots, qkv.stride(0), q.stride(0), q.stride(1),
            cos_table.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
            num_heads, num_kv_heads, HALF=D // 2, HP=next_pow2(D // 2), enable_fp_fusion=False)
    return q
