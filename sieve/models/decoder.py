"""One config-driven decoder for Llama, Mistral, Qwen2 and Qwen3.

Reads like the reference model: embed -> N x (norm, attention, norm, MLP) -> norm, except that each
residual add happens inside the norm that follows it (`norm(x, residual)`, as in vLLM), so the two
fuse into one kernel. Batch layout and pages are the attention layer's business; this file sees a
flat token batch [T, hidden].
"""

from __future__ import annotations

import torch
from torch import nn

from sieve.layers.activation import silu_and_mul
from sieve.layers.attention import Attention, AttentionMetadata, KVCacheLayer
from sieve.layers.linear import Linear
from sieve.layers.norm import RMSNorm
from sieve.layers.rotary import RopeStep, RotaryEmbedding, apply_rotary
from sieve.models.arch import ModelArch


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArch, dtype: torch.dtype):
        super().__init__()
        self.a = a
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.qkv_proj = Linear(a.hidden_size, [q_size, kv_size, kv_size], a.qkv_bias, dtype)
        self.o_proj = Linear(q_size, [a.hidden_size], a.o_bias, dtype)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype) if a.qk_norm else None
        self.attn = Attention(a.num_heads, a.num_kv_heads, a.head_dim)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.gate_up_proj = Linear(a.hidden_size, [a.intermediate_size] * 2, a.mlp_bias, dtype)
        self.down_proj = Linear(a.intermediate_size, [a.hidden_size], a.mlp_bias, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeStep, cache: KVCacheLayer, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (or the embeddings, with residual None); residual: the sum of
        everything before it. Returns (this layer's MLP output, the residual stream before it)."""
        a, T = self.a, x.shape[0]
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        qkv = self.qkv_proj(h)  # [T, (H + 2 KVH) * D]: q | k | v
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        v = qkv[:, q_size + kv_size :].view(T, a.num_kv_heads, a.head_dim)
        if self.q_norm is None:  # rotate q and k together: one pass over [T, H + KVH, D]
            qk = apply_rotary(qkv[:, : q_size + kv_size].view(T, -1, a.head_dim), rope)
            q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
        else:
            q = self.q_norm(qkv[:, :q_size].view(T, a.num_heads, a.head_dim))
            k = self.k_norm(qkv[:, q_size : q_size + kv_size].view(T, a.num_kv_heads, a.head_dim))
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        h, residual = self.post_attention_layernorm(self.o_proj(self.attn(q, k, v, cache, meta).view(T, -1)), residual)
        return self.down_proj(silu_and_mul(self.gate_up_proj(h))), residual


class DecoderModel(nn.Module):
    # checkpoint sub-module name -> (our module, shard index)
    _stacked = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, a: ModelArch, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.arch = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(a.head_dim, max_positions, a.rope_theta, a.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(a, dtype) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.lm_head = Linear(a.hidden_size, [a.vocab_size], False, dtype)
        self.kv_scales: dict[tuple[int, str], float] = {}  # (layer, "k" | "v") -> FP8 KV scale from the checkpoint
        if a.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one tensor: the embedding is the head

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCacheLayer], meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary(positions, x.dtype)
        for layer, cache in zip(self.layers, caches):
            x, residual = layer(x, residual, rope, cache, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> float32 logits [B, vocab]."""
        return self.lm_head(hidden).float()

    def prepare(self, allow_two_layouts: bool, quantization: str | None = None, group_size: int = 128,
                quantize_lm_head: bool = False) -> None:
        """After loading: let every linear layer pick its kernels (two weight layouts only if allowed).
        With `quantization`, the decoder layers' linears (and the LM head if asked; never the
        embedding or norms) take that weight format."""
        for name, m in self.named_modules():
            if isinstance(m, Linear):
                head = name == "lm_head"
                q = quantization if quantization and (not head or quantize_lm_head) else None
                if head and q == "awq":  # an AWQ checkpoint has no activation-aware scales for the head
                    q = "int4"
                if head and q and self.arch.tie_word_embeddings:
                    m.weight = nn.Parameter(m.weight.detach().clone(), requires_grad=False)  # untie: the embedding stays
                m.prepare(allow_two_layouts, q, group_size)

    # ---- weights ---------------------------------------------------------------------------
    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Load one checkpoint tensor by its Hugging Face name. False if the model has no use for it."""
        if name.startswith("model."):
            name = name[len("model.") :]
        if "rotary_emb" in name:
            return False
        if name == "lm_head.weight":
            if self.arch.tie_word_embeddings:
                return False  # tied: the embedding is the head
            self.lm_head.load("weight", tensor)
            return True
        parts = name.split(".")
        if parts[0] == "layers" and parts[-1] in ("k_scale", "v_scale"):  # FP8 KV-cache scales (vLLM / ModelOpt names)
            self.kv_scales[(int(parts[1]), parts[-1][0])] = float(tensor.float().reshape(-1).max())
            return True
        if parts[0] == "layers":  # layers.{i}.{self_attn|mlp}.{proj}.{weight|bias} or layers.{i}.{norm}.weight
            layer = self.layers[int(parts[1])]
            sub, leaf = parts[-2], parts[-1]
            if sub in self._stacked:
                module, shard = self._stacked[sub]
                getattr(layer, module).load(leaf, tensor, shard)
                return True
            if sub in ("o_proj", "down_proj"):
                getattr(layer, sub).load(leaf, tensor)
                return True
            target = getattr(layer, sub, None)
        else:
            target = self.get_submodule(".".join(parts[:-1]))
            leaf = parts[-1]
        param = getattr(target, leaf, None) if target is not None else None
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"checkpoint tensor {name!r} has no place in {self.arch.architecture}")
        if param.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
        param.data.copy_(tensor)
        return True
