"""Paged decode attention on CUDA in one Triton kernel whose result for a row depends on that row alone.

The PyTorch decode path (`attention.decode_attention_reference`) gathers every row's K/V padded to the
longest table and runs masked SDPA, so a row's arithmetic can depend on the rest of the batch: the padded
length and the number of rows are what SDPA's kernels choose by. In bfloat16 a rounding step is enough to flip
a near-tied greedy token, and a sequence verifying drafted tokens (its rows padded to its last draft) must
decode the tokens it decodes alone. On an H200 with the SmolLM2 GGUF file, bfloat16 speculation did not
("TOKENS DIFFER FROM OFF"; docs/design-notes.md, issue 15), float32 did.

Here one program takes one (row, KV head): the row's query heads of that group ([GROUP, D]) walk the row's
own blocks in order, block by block from its table, with an online softmax in float32 (the running max, the
sum of exponentials, the weighted values). Nothing in that depends on other rows, the table's padding or
how many rows there are: blocks past a row's context are skipped, so a row's output is the same bits alone,
next to longer rows, or as one of a sequence's drafted rows. It reads K/V in place (no gather, no padding
copy) from an exact cache of any float dtype (float32, bfloat16, float16); quantized caches keep the
PyTorch path.

One compiled kernel serves every call: no argument is specialized (attention_triton_kernel.py says why), and
the loop over a row's blocks is a while loop on the row's own length, which Triton's CPU interpreter
(TRITON_INTERPRET=1) runs as well, so the CPU suite tests this kernel too (tests/test_attention_triton.py).
"""

from __future__ import annotations

import functools
import os

import torch


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _kernel():
    """The jitted kernel, imported once (a CPU process never imports triton), or None where triton is missing."""
    try:
        from sieve.layers.attention_triton_kernel import paged_decode
    except ImportError:
        return None
    return paged_decode


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (>= 1): a Triton block's width."""
    return 1 << max(0, (x - 1).bit_length())


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, quantized: bool) -> bool:
    """A CUDA query over an exact float cache whose block size is a power of two (or any device under Triton's
    interpreter, which the CPU tests use)."""
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if quantized or q.dtype not in _FLOATS or k_cache.dtype not in _FLOATS:
        return False
    bs = k_cache.shape[1]
    if bs & (bs - 1) or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return False
    return _kernel() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, first_visible: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D]; caches [num_blocks, block_size, KVH, D]; block_tables [n, width] (rows padded with any block);
    context_lens [n] (keys 0 .. len - 1 of each row's table); first_visible [n] or None (a sliding window's first
    key) -> [n, H, D] in q's dtype."""
    n, H, D = q.shape
    KVH, bs = k_cache.shape[2], k_cache.shape[1]
    if H % KVH or k_cache.shape[3] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)} does not fit a cache of {tuple(k_cache.shape)}")
    q = q.contiguous()
    out = torch.empty_like(q)
    if n == 0:
        return out
    group = H // KVH
    _kernel()[(n, KVH)](
        q, k_cache, v_cache, block_tables, context_lens, first_visible if first_visible is not None else context_lens, out,
        float(scale), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GP=next_pow2(group), D=D, DP=next_pow2(D), BS=bs,
        HAS_FIRST=first_visible is not None, num_warps=4)
    return out
