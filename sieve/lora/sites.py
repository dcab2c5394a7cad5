"""Where an adapter's low-rank products go: the linears of sieve's model that LoRA runs on (its sites), what PEFT
calls each, and their shapes.

A site is named as the model calls it, per layer:
- plain attention: `qkv_proj` (PEFT's q_proj, k_proj and v_proj: shards 0-2 of the fused output) and `o_proj`, in
  every family's attention layers, a mixture-of-experts model's and a hybrid's included;
- a dense MLP (any family's, a hybrid's and DeepSeek's first layers included): `gate_up_proj` (gate_proj and
  up_proj) and `down_proj`;
- a mixture-of-experts block's shared expert (Qwen2-MoE's `shared_expert`, DeepSeek's `shared_experts`):
  `shared_expert.gate_up_proj` and `shared_expert.down_proj`;
- latent attention (DeepSeek): `mla.q_proj` (or `mla.q_a_proj` and `mla.q_b_proj`), `mla.kv_a_proj_with_mqa`,
  `mla.kv_b_proj` (whose product is absorbed as its weight is: sieve/layers/mla.py) and `mla.o_proj`;
- a Mamba-2 mixer: `mamba.in_proj` and `mamba.out_proj`;
and the model's own, at layer MODEL (-1): `lm_head` (the logits of an adapter's rows) and `embed_tokens` (PEFT's
lora_embedding_A [r, vocab] and lora_embedding_B [hidden, r]: a row's A column, times B, added to its embedding).

The model's routed experts are 3-D parameters in transformers (no linear PEFT's `target_modules` reaches), and its
routers are refused by name."""

from __future__ import annotations

import re

# PEFT's key of a decoder layer's LoRA matrix: (layer, the module's path inside the layer, A or B)
KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
# PEFT's key of the head's or the embedding's: (the module, A or B)
MODEL_KEY = re.compile(r"^base_model\.model\.(?:model\.)?(lm_head|embed_tokens)\.lora_(?:embedding_)?([AB])(?:\.weight)?$")
MODEL = -1  # the layer index of the model's own sites
ATTENTION = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0)}
MLP = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
MLP_BLOCKS = ("mlp", "feed_forward", "block_sparse_moe")  # what the families call a layer's MLP block
SHARED_EXPERT = ("shared_expert", "shared_experts")
MAMBA = ("in_proj", "out_proj")
NAMES = ("q/k/v/o_proj, gate/up/down_proj (shared experts' too), latent attention's projections, Mamba's in/out_proj, "
         "lm_head, embed_tokens")


def dense_sites(arch) -> dict[str, tuple[int, list[int]]]:
    """Plain attention's and a dense MLP's sites -> (in features, their shards' out features)."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return {"qkv_proj": (arch.hidden_size, [q, kv, kv]), "o_proj": (q, [arch.hidden_size]),
            "gate_up_proj": (arch.hidden_size, [arch.intermediate_size] * 2), "down_proj": (arch.intermediate_size, [arch.hidden_size])}


def layer_sites(arch, layer: int) -> dict[str, tuple[int, list[int]]]:
    """The sites layer `layer` (MODEL: the model's own) of a model of `arch` has -> (in features, their shards' out
    features)."""
    a, dense, out = arch, dense_sites(arch), {}
    if layer == MODEL:
        return {"lm_head": (a.hidden_size, [a.vocab_size]), "embed_tokens": (a.vocab_size, [a.hidden_size])}
    if layer in a.mamba_layers:
        out["mamba.in_proj"] = (a.hidden_size, [a.mamba_intermediate + a.mamba_conv_dim + a.mamba_n_heads])
        out["mamba.out_proj"] = (a.mamba_intermediate, [a.hidden_size])
    elif a.is_mla:
        H, q = a.num_heads, a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
        if a.q_lora_rank:
            out["mla.q_a_proj"], out["mla.q_b_proj"] = (a.hidden_size, [a.q_lora_rank]), (a.q_lora_rank, [q])
        else:
            out["mla.q_proj"] = (a.hidden_size, [q])
        out["mla.kv_a_proj_with_mqa"] = (a.hidden_size, [a.kv_lora_rank + a.qk_rope_head_dim])
        out["mla.kv_b_proj"] = (a.kv_lora_rank, [H * (a.qk_nope_head_dim + a.v_head_dim)])
        out["mla.o_proj"] = (H * a.v_head_dim, [a.hidden_size])
    else:
        out["qkv_proj"], out["o_proj"] = dense["qkv_proj"], dense["o_proj"]
    if layer not in a.sparse_layers:
        out["gate_up_proj"], out["down_proj"] = dense["gate_up_proj"], dense["down_proj"]
    elif a.shared_expert_intermediate_size:
        s = a.shared_expert_intermediate_size
        out["shared_expert.gate_up_proj"], out["shared_expert.down_proj"] = (a.hidden_size, [s, s]), (s, [a.hidden_size])
    return out


def site_of(arch, layer: int, path: str) -> tuple[str, int]:
    """(site, shard) of the module PEFT names `path` inside layer `layer` ("self_attn.q_proj",
    "mlp.shared_expert.up_proj", ...; at MODEL, "lm_head" or "embed_tokens"); a ValueError saying why where LoRA
    does not run on it here."""
    if layer == MODEL:
        return path, 0
    if not 0 <= layer < arch.num_layers:
        raise ValueError(f"layer {layer} is out of range (the model has layers 0 .. {arch.num_layers - 1})")
    sites = layer_sites(arch, layer)
    block, _, name = path.partition(".")
    found = None
    if block == "self_attn" and "qkv_proj" in sites:
        found = ATTENTION.get(name)
    elif block == "self_attn" and arch.is_mla:
        found = ("mla." + name, 0)
    elif block == "mamba" and name in MAMBA:
        found = ("mamba." + name, 0)
    elif block in MLP_BLOCKS and name in MLP:
        found = MLP[name]
    elif block in MLP_BLOCKS and name.partition(".")[0] in SHARED_EXPERT and name.partition(".")[2] in MLP:
        site, shard = MLP[name.partition(".")[2]]
        found = ("shared_expert." + site, shard)
    if found is not None and found[0] in sites:
        return found
    if block in MLP_BLOCKS and layer in arch.sparse_layers:
        raise ValueError(f"layer {layer}'s {path}: a mixture-of-experts block takes LoRA on its shared expert only "
                         "(routed experts are 3-D parameters, and the router is not served with an adapter)")
    raise ValueError(f"layer {layer} has no {path!r} that LoRA runs on here (sites: {NAMES})")
