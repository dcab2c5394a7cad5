"""Multi-head latent attention (DeepSeek-V2/V3), in its absorbed form, over the ordinary paged cache.

Each token caches one vector per layer: its compressed latent c (kv_lora_rank, after kv_a_layernorm) and the rope
key shared by every head (qk_rope_head_dim), concatenated: the cache is a single "KV head" of width r + rope,
and nothing else (no V). Per head h the model's keys and values are k_h = [W_UK_h c ; k_rope] and v_h = W_UV_h c,
with W_UK and W_UV the two halves of kv_b_proj. Absorbing them (DeepSeek-V2 paper, section 2.1.2):
  q_h . k_h = (W_UK_h^T q_nope_h) . c + q_rope_h . k_rope,   sum_t p_t v_h,t = W_UV_h (sum_t p_t c_t),
so attention runs as multi-query attention of H query heads over the cached [c ; k_rope] rows, with those same
rows as values (the first r output dims are the latent mix; the rope dims are dropped), then W_UV and o_proj.
Prefill and decode take this one path (and with it the paged layer's chunking, windows and native decode
kernel), so a token's result does not depend on how its prompt was chunked.
"""

from __future__ import annotations

import torch
from torch import nn

from sieve.layers.attention import Attention, AttentionMetadata, KVCacheLayer
from sieve.layers.linear import Linear
from sieve.layers.norm import RMSNorm
from sieve.layers.rotary import RopeStep, apply_rotary

LORA_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with the default eps, not rms_norm_eps


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, a, dtype: torch.dtype):
        super().__init__()
        H, r, rope, nope, v = a.num_heads, a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim
        self.H, self.r, self.rope, self.nope, self.v = H, r, rope, nope, v
        if a.q_lora_rank:
            self.q_a_proj = Linear(a.hidden_size, [a.q_lora_rank], False, dtype)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = Linear(a.q_lora_rank, [H * (nope + rope)], False, dtype)
        else:
            self.q_proj = Linear(a.hidden_size, [H * (nope + rope)], False, dtype)
        self.kv_a_proj_with_mqa = Linear(a.hidden_size, [r + rope], False, dtype)
        self.kv_a_layernorm = RMSNorm(r, LORA_NORM_EPS, dtype)
        # kv_b_proj, split per head into its key half (absorbed into the query) and value half (applied after)
        self.w_uk = nn.Parameter(torch.empty(H, nope, r, dtype=dtype), requires_grad=False)
        self.w_uv = nn.Parameter(torch.empty(H, v, r, dtype=dtype), requires_grad=False)
        self.o_proj = Linear(H * v, [a.hidden_size], False, dtype)
        self.attn = Attention(H, 1, r + rope, (nope + rope) ** -0.5)
        # DeepSeek-V3 lays each rope vector out as interleaved pairs: read them even dims first, then odd, and the
        # usual rotate-half rotation is the pairwise one (transformers' own form of it is the same arithmetic)
        self.register_buffer("rope_order", torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
                             if a.rope_interleave else None, persistent=False)

    def forward(self, h: torch.Tensor, rope: RopeStep, cache: KVCacheLayer, meta: AttentionMetadata, adapt=None) -> torch.Tensor:
        """`adapt` (sieve/lora LayerLoRA): the step's adapters, at sites mla.<projection>; kv_b_proj's product is
        absorbed as its weight is (`_absorbed_keys`, `_absorbed_values`)."""
        T, H, r = h.shape[0], self.H, self.r
        proj = (lambda name, x: getattr(self, name)(x)) if adapt is None else (lambda name, x: adapt("mla." + name, x, getattr(self, name)(x)))
        q = proj("q_b_proj", self.q_a_layernorm(proj("q_a_proj", h))) if hasattr(self, "q_b_proj") else proj("q_proj", h)
        q = q.view(T, H, self.nope + self.rope)
        latent = proj("kv_a_proj_with_mqa", h)
        c = self.kv_a_layernorm(latent[:, :r].contiguous())
        q_pe, k_pe = q[..., self.nope :], latent[:, r:].view(T, 1, self.rope)
        if self.rope_order is not None:
            q_pe, k_pe = q_pe[..., self.rope_order], k_pe[..., self.rope_order]
        q_pe, k_pe = apply_rotary(q_pe.contiguous(), rope), apply_rotary(k_pe.contiguous(), rope)
        q_latent = self._absorbed_keys(q[..., : self.nope], adapt)
        query = torch.cat([q_latent, q_pe], dim=-1)  # [T, H, r + rope]
        key = torch.cat([c.view(T, 1, r), k_pe], dim=-1)  # [T, 1, r + rope]: what the cache holds
        mixed = self.attn(query, key, key, cache, meta)[..., :r]  # values are the cached rows; keep the latent dims
        return proj("o_proj", self._absorbed_values(mixed, adapt).reshape(T, H * self.v))

    def _absorbed_keys(self, q_nope: torch.Tensor, adapt) -> torch.Tensor:
        """q_nope [T, H, nope] -> [T, H, r]: W_UK_h^T q_nope_h per head. An adapter's kv_b_proj (B A, B's rows per head
        in kv_b_proj's order) adds its key half, (B_K,h A)^T q = A^T (B_K,h^T q): through its rank, never a full
        matrix."""
        out = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)
        for rows, at, bt in adapt.each("mla.kv_b_proj") if adapt is not None else ():
            b = bt.to(out.dtype).t().reshape(self.H, self.nope + self.v, -1)[:, : self.nope]  # [H, nope, R]
            out[rows] += torch.einsum("thn,hnR->thR", q_nope[rows], b) @ at.to(out.dtype).t()
        return out

    def _absorbed_values(self, mixed: torch.Tensor, adapt) -> torch.Tensor:
        """mixed [T, H, r] (the latent the attention mixed) -> [T, H, v]: W_UV_h per head, plus an adapter's value
        half, B_V,h (A mixed)."""
        out = torch.einsum("thr,hvr->thv", mixed, self.w_uv)
        for rows, at, bt in adapt.each("mla.kv_b_proj") if adapt is not None else ():
            b = bt.to(out.dtype).t().reshape(self.H, self.nope + self.v, -1)[:, self.nope :]  # [H, v, R]
            out[rows] += torch.einsum("thR,hvR->thv", mixed[rows] @ at.to(out.dtype), b)
        return out

    def load_weight(self, parts: list[str], tensor: torch.Tensor) -> None:
        """parts: a checkpoint name after `self_attn.` ('q_a_proj.weight', 'kv_b_proj.weight', ...)."""
        name, leaf = parts[0], parts[-1]
        if name == "kv_b_proj" and leaf == "weight":
            w = tensor.view(self.H, self.nope + self.v, self.r)
            self.w_uk.data.copy_(w[:, : self.nope])
            self.w_uv.data.copy_(w[:, self.nope :])
            return
        module = getattr(self, name, None)
        if isinstance(module, Linear) and len(parts) == 2:
            module.load(leaf, tensor)
            return
        if isinstance(module, RMSNorm) and parts[1:] == ["weight"]:
            module.weight.data.copy_(tensor)
            return
        raise ValueError(f"checkpoint tensor self_attn.{'.'.join(parts)} has no place in multi-head latent attention")
