"""Paged attention over a flattened batch. The only layer that knows about blocks.

The model runner lays a step out as decode tokens first (one per sequence), then prefill chunks.
Every new K/V is written to its cache slot; then
  - decodes attend in one batched call, reading K/V through their block tables (on CPU a native
    kernel reads them in place from the pool; elsewhere a padded gather + SDPA);
  - each prefill chunk attends to its earlier context (read through its block table) plus itself,
    with a causal mask aligned to the chunk's end.
A later KV dtype (FP8/INT8) changes only `write_kv` and `read_kv`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sieve.kernels import cpu_ops


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the flattened batch
    num_tokens: int  # query length
    context_len: int  # tokens attended to: earlier context + this chunk
    block_table: torch.Tensor  # [ceil(context_len / block_size)] int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) of each token
    num_decodes: int  # rows [0, num_decodes) are decode tokens
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64
    prefills: list[PrefillChunk]


class KVCacheLayer:
    """One layer's view of the pool: K and V as [num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v
        self.block_size = k.shape[1]

    def write_kv(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.view(-1, *self.k.shape[2:]).index_copy_(0, slots, k.to(self.k.dtype))
        self.v.view(-1, *self.v.shape[2:]).index_copy_(0, slots, v.to(self.v.dtype))

    def read_kv(self, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """block_table [..., nb] -> K, V [..., nb * block_size, kv_heads, head_dim]."""
        k = self.k[block_table].flatten(-4, -3)
        v = self.v[block_table].flatten(-4, -3)
        return k.to(dtype), v.to(dtype)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
        cache.write_kv(meta.slot_mapping, k, v)
        nd = meta.num_decodes
        if not meta.prefills:  # decode-only step: no output buffer to assemble
            return self._decode(q, cache, meta)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if chunk.context_len == chunk.num_tokens:  # no earlier context: attend to the chunk itself
                kc, vc, mask = k[rows], v[rows], None
            else:
                kc, vc = cache.read_kv(chunk.block_table, q.dtype)
                kc, vc = kc[: chunk.context_len], vc[: chunk.context_len]
                mask = _causal_mask_bottom_right(chunk.num_tokens, chunk.context_len, q.device)
            out[rows] = F.scaled_dot_product_attention(
                qc,
                kc.transpose(0, 1).unsqueeze(0),  # [1, KVH, ctx, D]
                vc.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=True,
            )[0].transpose(0, 1)
        return out


    def _decode(self, q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata) -> torch.Tensor:
        """q [nd, H, D], one token per sequence at the end of its context -> [nd, H, D]."""
        ops = cpu_ops() if q.device.type == "cpu" and cache.k.dtype == q.dtype else None
        if ops is not None:  # native: reads K/V in place from the pool, no padding
            return ops.paged_decode_attention(q.contiguous(), cache.k, cache.v, meta.decode_block_tables,
                                              meta.decode_context_lens, self.scale)
        return decode_attention_reference(q, cache, meta, self.scale)


def decode_attention_reference(q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """PyTorch path (any device): gather each table padded to the longest, masked SDPA."""
    kc, vc = cache.read_kv(meta.decode_block_tables, q.dtype)  # [nd, L, KVH, D]
    visible = torch.arange(kc.shape[1], device=q.device)[None, :] < meta.decode_context_lens[:, None]  # [nd, L]
    return F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [nd, H, 1, D]
        kc.transpose(1, 2),  # [nd, KVH, L, D]
        vc.transpose(1, 2),
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    ).squeeze(2)


def _causal_mask_bottom_right(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """[n, ctx] bool: query i (at absolute position ctx - n + i) sees keys 0..ctx - n + i."""
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device).unsqueeze(1)
    return torch.arange(num_keys, device=device).unsqueeze(0) <= q_pos
