"""Paged attention over a flattened batch. The only layer that knows about blocks.

The model runner lays a step out as decode tokens first (one per sequence), then prefill chunks.
Every new K/V is written to its cache slot; then
  - decodes attend in one batched call, reading K/V through their block tables (on CPU a native
    kernel reads them in place from the pool; on CUDA a Triton kernel does, each row's result independent
    of the rest of the batch (attention_triton.py); a quantized cache on CUDA: a padded gather + SDPA);
  - each prefill chunk attends to its earlier context (read through its block table) plus itself,
    with a causal mask aligned to the chunk's end; on CPU with the native kernels under float32 activations (no
    sliding window), each of its rows goes through the decode kernel instead, over its own context (as
    sieve/kernels/decoder.cpp does): a row's result is then the same
    whatever chunk it is in (SDPA sums a row's keys in blocks that follow where the chunk starts) and the same
    as when that position is a decode row.
A sliding-window layer (window W: a query at position p sees keys p - W < k <= p) gets its window's own
metadata (`meta.windows[W]`, built once per step by the model runner): tables that start at the first
block inside the window (`key_start`: the position of their first slot), so it never reads a block that
has left its window. The native decode kernel starts each row at its first visible key
(`decode_first_visible`); the PyTorch paths mask by position.
A quantized KV cache (FP8 with a per-layer scale, INT8 with a scale per token and head) changes only
`write_kv` and `read_kv` (`QuantizedKVCacheLayer`) and hands its scales to the native decode kernel,
which reads the codes in place; the PyTorch decode path reads through `read_kv`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from sieve.kernels import cpu_ops
from sieve.layers import attention_triton, pointwise_triton
from sieve.quant.formats import quantize_int8_rows


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the flattened batch
    num_tokens: int  # query length
    context_len: int  # tokens attended to: earlier context + this chunk
    block_table: torch.Tensor  # [ceil(context_len / block_size)] int64 (a window's view: from block key_start / bs)
    key_start: int = 0  # position of the first slot of block_table (0 but in a window's view)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) of each token
    num_decodes: int  # rows [0, num_decodes) are decode tokens
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64
    prefills: list[PrefillChunk]
    # A sliding window's view (in `windows` of the full view): where some row's window leaves out part of its context,
    # each row's first visible key as a slot of its table. A view's decode tables start at the first block holding a
    # visible key, and its decode_context_lens count slots from there.
    decode_first_visible: torch.Tensor | None = None  # [num_decodes] int64
    windows: dict[int, "AttentionMetadata"] = field(default_factory=dict)  # window size -> its view (full view only)
    recurrent: object = None  # Mamba-2 layers: which state slot each row continues (sieve.layers.mamba.RecurrentMetadata)
    # KV compression (sieve/kv_compression). A pass over positions whose K/V the cache holds already writes nothing
    # (`write_kv` False); with `capture` a list, each attention layer appends its rotated queries [T, H, D] to it (the
    # queries of SnapKV's window). `query_taps`: rows whose queries before rotation each attention layer hands to
    # their tap (expected attention's query statistics), in a step or in such a pass.
    write_kv: bool = True
    capture: list | None = None
    query_taps: list["QueryTap"] = field(default_factory=list)
    lora: object = None  # LoRA: the step's rows grouped by adapter (sieve/lora LoRABatch), or None
    # KV compression with per-layer budgets (sieve/kv_compression/cells.py): a step with such a sequence gives each
    # attention layer a view of its own (`layers`, by layer index), whose tables index the pool flattened over its
    # layers' planes (`flat`: read through the cache's `flat` view; the K/V the step writes go to the layer's own plane)
    layers: dict[int, "AttentionMetadata"] | None = None
    flat: bool = False

    def for_layer(self, layer: int) -> "AttentionMetadata":
        """Layer `layer`'s view of the step (`layers`), with what the step sets after building it (the K/V write, the
        captures, the taps, the adapters) the step's own; the step itself where it has no views."""
        view = self.layers.get(layer) if self.layers else None
        if view is None:
            return self
        view.write_kv, view.capture, view.query_taps, view.lora = self.write_kv, self.capture, self.query_taps, self.lora
        return view


@dataclass
class QueryTap:
    """Rows [row, row + num_rows) of a step whose queries before rotation go to `sink.add(layer, q [n, H, D])`, once
    per attention layer (`layer` the model's layer index)."""

    row: int
    num_rows: int
    sink: object


def build_metadata(slots: list[int], decodes: list[tuple[list[int], int]], prefills: list[tuple[int, int, int, list[int]]],
                   block_size: int, device: torch.device, windows: tuple[int, ...] = ()) -> AttentionMetadata:
    """A step's metadata from plain lists: each cache slot written; each decode row's (block table, context
    length), the table no longer than its context needs; each prefill chunk's (first row, query length, context
    length, block table), the table possibly longer. With `windows`, also each sliding window's view of the
    same tables."""
    bs = block_size

    def meta_for(window: int | None) -> AttentionMetadata:
        tables, lens, visible = [], [], []
        for table, ctx in decodes:
            first = max(0, ctx - window) // bs if window else 0  # the first block holding a key this row sees
            tables.append(table[first:] if first else table)
            lens.append(ctx - first * bs)
            visible.append(max(0, ctx - window) - first * bs if window else 0)
        chunks = []
        for row, n, ctx, table in prefills:
            first = max(0, ctx - n - window + 1) // bs if window else 0
            chunks.append(PrefillChunk(row, n, ctx, torch.tensor(table[first : -(-ctx // bs)], dtype=torch.int64, device=device),
                                       first * bs))
        m = AttentionMetadata(slot_mapping, len(tables), None, None, chunks)
        if tables:
            width = max(len(t) for t in tables)
            m.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=device)
            m.decode_context_lens = torch.tensor(lens, dtype=torch.int64, device=device)
            if any(visible):
                m.decode_first_visible = torch.tensor(visible, dtype=torch.int64, device=device)
        return m

    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    meta = meta_for(None)
    meta.windows = {w: meta_for(w) for w in sorted(set(windows))}
    return meta


class KVCacheLayer:
    """One layer's view of the pool: K and V as [num_blocks, block_size, kv_heads, head_dim]."""

    native_loop = True  # the C++ layer loop (sieve/kernels/decoder.cpp) reads and writes this cache
    flat: "KVCacheLayer | None" = None  # the same layer's reads over its group's pool flattened across planes

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v
        self.block_size = k.shape[1]
        self.k_scale = self.v_scale = None  # quantized caches: what the native decode kernel needs to read codes

    def stores_exactly(self, dtype: torch.dtype) -> bool:
        """Whether K/V of `dtype` read back equal what was written. If not (a 16-bit cache under float32, fp8, int8),
        prefill attends to the keys as stored, its own included, so that a chunk sees what a later chunk, a decode
        step or a prefix-cache hit sees."""
        return self.k.dtype == dtype

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

    @property
    def native_loop(self) -> bool:
        """The C++ layer loop writes and reads these codes too, once fp8's scales are known (it does not calibrate)."""
        return not self.calibrate

    def _quant(self, x: torch.Tensor, scale_store: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if self.kind == "fp8":
            return (x.float() / scale_store).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        codes, s = quantize_int8_rows(x)  # s: [T, KVH], float16 as stored
        scale_store.view(-1, scale_store.shape[-1]).index_copy_(0, slots, s.to(scale_store.dtype))
        return codes

    # Copies and gathers go through byte views: CPU kernels for them do not all exist for float8.
    def write_kv(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.calibrate:
            self.k_scale.fill_(max(k.abs().max().item() * self.FP8_MARGIN / 448.0, 1e-6))
            self.v_scale.fill_(max(v.abs().max().item() * self.FP8_MARGIN / 448.0, 1e-6))
            self.calibrate = False
        for pool, x, scale in ((self.k, k, self.k_scale), (self.v, v, self.v_scale)):
            pool.view(torch.uint8).view(-1, *pool.shape[2:]).index_copy_(0, slots, self._quant(x, scale, slots).view(torch.uint8))

    def stores_exactly(self, dtype: torch.dtype) -> bool:
        return False

    def read_kv(self, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k.view(torch.uint8)[block_table].view(self.k.dtype).flatten(-4, -3).float()
        v = self.v.view(torch.uint8)[block_table].view(self.v.dtype).flatten(-4, -3).float()
        if self.kind == "fp8":
            return (k * self.k_scale).to(dtype), (v * self.v_scale).to(dtype)
        ks = self.k_scale[block_table].flatten(-3, -2).float()[..., None]
        vs = self.v_scale[block_table].flatten(-3, -2).float()[..., None]
        return (k * ks).to(dtype), (v * vs).to(dtype)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None, window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window  # sliding window (keys p - W < k <= p), or None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
        if meta.write_kv:
            cache.write_kv(meta.slot_mapping, k, v)
        if meta.capture is not None:
            meta.capture.append(q)
        if meta.flat:  # tables over the flattened pool (per-layer budgets): K/V written above, read through it
            cache = cache.flat
        nd = meta.num_decodes
        if not meta.prefills:  # decode-only step: no output buffer to assemble
            return self._decode(q, cache, meta)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], cache, meta)
        # (as the C++ layer loop: under float32, and over fp8 / int8 codes, which SDPA would need widened first)
        quantized = cache.k_scale is not None
        ops = cpu_ops() if q.device.type == "cpu" and (q.dtype == torch.float32 or quantized) and self.window is None else None
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            if ops is not None:  # native: each row alone over its context, as a decode row (and as decoder.cpp does)
                n, ctx = chunk.num_tokens, chunk.context_len
                out[rows] = ops.paged_decode_attention(
                    q[rows].contiguous(), cache.k, cache.v, chunk.block_table.to(torch.int64).expand(n, -1).contiguous(),
                    torch.arange(ctx - n + 1, ctx + 1), self.scale, cache.k_scale, cache.v_scale, None)
                continue
            qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            own = chunk.context_len == chunk.num_tokens or chunk.key_start >= chunk.context_len - chunk.num_tokens
            if own and cache.stores_exactly(q.dtype):
                kc, vc, first = k[rows], v[rows], chunk.context_len - chunk.num_tokens  # the chunk's own keys suffice
            else:
                kc, vc = cache.read_kv(chunk.block_table, q.dtype)
                first = chunk.key_start
                kc, vc = kc[: chunk.context_len - first], vc[: chunk.context_len - first]
            mask = _causal_mask(chunk.num_tokens, chunk.context_len, first, self.window, q.device)
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


    def writes_fused(self, qkv: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata) -> bool:
        """Whether this step's rotary and K/V write may be one launch before `decode_written` (CUDA, sieve/layers/
        pointwise_triton.py): decode rows only, written, nothing captured, an exact float cache."""
        return (not meta.prefills and meta.write_kv and meta.capture is None and cache.k_scale is None
                and pointwise_triton.supports_rotary_write(qkv, cache.k, cache.v))

    def decode_written(self, q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata) -> torch.Tensor:
        """Decode rows whose K/V the cache already holds (`writes_fused`): q [nd, H, D] -> [nd, H, D]."""
        return self._decode(q, cache.flat if meta.flat else cache, meta)

    def _decode(self, q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata) -> torch.Tensor:
        """q [nd, H, D], one token per sequence at the end of its context -> [nd, H, D]."""
        ops = cpu_ops() if q.device.type == "cpu" else None
        if ops is not None:  # native: reads K/V (or their fp8 / int8 codes) in place from the pool, no padding
            return ops.paged_decode_attention(q.contiguous(), cache.k, cache.v, meta.decode_block_tables,
                                              meta.decode_context_lens, self.scale, cache.k_scale, cache.v_scale,
                                              meta.decode_first_visible)
        if attention_triton.supports(q, cache.k, cache.v, quantized=cache.k_scale is not None):  # CUDA: each row alone, in place
            return attention_triton.paged_decode_attention(q, cache.k, cache.v, meta.decode_block_tables,
                                                           meta.decode_context_lens, self.scale, meta.decode_first_visible)
        return decode_attention_reference(q, cache, meta, self.scale)


def decode_attention_reference(q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """PyTorch path (any device): gather each table padded to the longest, masked SDPA (by position in a
    sliding window's view)."""
    kc, vc = cache.read_kv(meta.decode_block_tables, q.dtype)  # [nd, L, KVH, D]
    slot = torch.arange(kc.shape[1], device=q.device)[None, :]
    visible = slot < meta.decode_context_lens[:, None]  # [nd, L]
    if meta.decode_first_visible is not None:  # a sliding window's view
        visible &= slot >= meta.decode_first_visible[:, None]
    return F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [nd, H, 1, D]
        kc.transpose(1, 2),  # [nd, KVH, L, D]
        vc.transpose(1, 2),
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    ).squeeze(2)


def _causal_mask(num_queries: int, context_len: int, first_key: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """[n, keys] bool for queries at positions context_len - n .. context_len - 1 over keys at positions
    first_key .. context_len - 1: causal (k <= q) and, with a window, k > q - window. None when that is
    SDPA's own top-left causal mask (queries and keys the same positions, no window cutting)."""
    q_pos = torch.arange(context_len - num_queries, context_len, device=device).unsqueeze(1)
    if first_key == context_len - num_queries and (window is None or num_queries <= window):
        return None
    k_pos = torch.arange(first_key, context_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
