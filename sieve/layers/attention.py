"""Paged attention over a flattened batch. The only layer that knows about blocks.

The model runner lays a step out as decode tokens first (one per sequence), then prefill chunks.
Every new K/V is written to its cache slot; then
  - decodes attend in one batched call, reading K/V through their block tables (on CPU a native
    kernel reads them in place from the pool; elsewhere a padded gather + SDPA);
  - each prefill chunk attends to its earlier context (read through its block table) plus itself,
    with a causal mask aligned to the chunk's end.
A quantized KV cache (FP8 with a per-layer scale, INT8 with a scale per token and head) changes only
`write_kv` and `read_kv` (`QuantizedKVCacheLayer`) and hands its scales to the native decode kernel,
which reads the codes in place; the PyTorch decode path reads through `read_kv`.
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
        self.k_scale = self.v_scale = None  # quantized caches: what the native decode kernel needs to read codes

    def write_kv(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.view(-1, *self.k.shape[2:]).index_copy_(0, slots, k.to(self.k.dtype))
        self.v.view(-1, *self.v.shape[2:]).index_copy_(0, slots, v.to(self.v.dtype))

    def read_kv(self, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """block_table [..., nb] -> K, V [..., nb * block_size, kv_heads, head_dim]."""
        k = self.k[block_table].flatten(-4, -3)
        v = self.v[block_table].flatten(-4, -3)
        return k.to(dtype), v.to(dtype)


class QuantizedKVCacheLayer(KVCacheLayer):
    """K/V stored as fp8 (e4m3, x = q * scale, one scale per layer for K and one for V) or int8
    (x = q * scale[token, head], scales kept as float16 beside the blocks).

    FP8 scales come from the checkpoint when it has them; otherwise they are calibrated on the first
    batch written (as vLLM's `calculate_kv_scales`): amax x FP8_MARGIN / 448, so later values up to
    FP8_MARGIN times larger still fit before clamping. The engine writes fixed text first, at load."""

    FP8_MARGIN = 2.0

    def __init__(self, k: torch.Tensor, v: torch.Tensor, kind: str, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, calibrate: bool = False):
        super().__init__(k, v)
        self.kind = kind
        self.k_scale, self.v_scale = k_scale, v_scale  # fp8: float32 scalars; int8: [num_blocks, block_size, kv_heads]
        self.calibrate = calibrate and kind == "fp8"

    def _quant(self, x: torch.Tensor, scale_store: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if self.kind == "fp8":
            return (x.float() / scale_store).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        s = (x.float().abs().amax(dim=-1) / 127).clamp(min=1e-8)  # [T, KVH]
        scale_store.view(-1, scale_store.shape[-1]).index_copy_(0, slots, s.to(scale_store.dtype))
        s = s.to(scale_store.dtype).float()  # what will be read back
        return torch.round(x.float() / s[..., None]).clamp(-127, 127).to(torch.int8)

    # Copies and gathers go through byte views: CPU kernels for them do not all exist for float8.
    def write_kv(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.calibrate:
            self.k_scale.fill_(max(k.abs().max().item() * self.FP8_MARGIN / 448.0, 1e-6))
            self.v_scale.fill_(max(v.abs().max().item() * self.FP8_MARGIN / 448.0, 1e-6))
            self.calibrate = False
        for pool, x, scale in ((self.k, k, self.k_scale), (self.v, v, self.v_scale)):
            pool.view(torch.uint8).view(-1, *pool.shape[2:]).index_copy_(0, slots, self._quant(x, scale, slots).view(torch.uint8))

    def read_kv(self, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k.view(torch.uint8)[block_table].view(self.k.dtype).flatten(-4, -3).float()
        v = self.v.view(torch.uint8)[block_table].view(self.v.dtype).flatten(-4, -3).float()
        if self.kind == "fp8":
            return (k * self.k_scale).to(dtype), (v * self.v_scale).to(dtype)
        ks = self.k_scale[block_table].flatten(-3, -2).float()[..., None]
        vs = self.v_scale[block_table].flatten(-3, -2).float()[..., None]
        return (k * ks).to(dtype), (v * vs).to(dtype)


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
        ops = cpu_ops() if q.device.type == "cpu" else None
        if ops is not None:  # native: reads K/V (or their fp8 / int8 codes) in place from the pool, no padding
            return ops.paged_decode_attention(q.contiguous(), cache.k, cache.v, meta.decode_block_tables,
                                              meta.decode_context_lens, self.scale, cache.k_scale, cache.v_scale)
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
