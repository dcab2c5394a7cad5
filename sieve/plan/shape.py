"""Parameters, weight bytes and KV bytes per token, read from a Hugging Face `config.json`.

Covers dense Llama / Mistral / Qwen2 / Qwen3 / Gemma 3, mixture-of-experts (Mixtral, Qwen2/3-MoE, DeepSeek:
total against active parameters), DeepSeek's multi-head latent attention (a latent KV cache), and
sliding-window layers (Gemma 3, Mistral-style): a sliding layer caches and reads at most its window.
"""

from __future__ import annotations

from dataclasses import dataclass

# bytes per parameter of a quantized linear weight, and how scales are counted
WEIGHT_FORMATS = ("fp16", "bf16", "fp8", "int8", "w8a8", "int4")  # w8a8: int8 weights against int8 activations
KV_FORMATS = ("fp16", "bf16", "fp8", "int8")
INT4_GROUP = 128


@dataclass(frozen=True)
class LinearShape:
    out_features: int
    in_features: int
    count: float = 1.0  # how many such matrices a step reads (experts: the active share)

    @property
    def params(self) -> float:
        return self.out_features * self.in_features * self.count


@dataclass
class ModelShape:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    head_dim: int  # q/k head size (for MLA: nope + rope)
    vocab: int
    tied: bool
    kv_elems_per_token_per_layer: int  # K and V (or MLA latent + rope key) elements cached per token per layer
    linears_total: list[LinearShape]  # every quantizable matrix in the model
    linears_active: list[LinearShape]  # what one token reads (MoE: routed experts per token + shared)
    small_params: int  # norms and biases (kept in 16-bit)
    is_moe: bool = False
    is_mla: bool = False
    window_layers: int = 0  # layers attending to a sliding window (they cache at most `window` tokens)
    window: int = 0
    state_layers: int = 0  # Mamba-2 layers: no KV, a fixed state per sequence instead
    state_bytes_per_sequence: int = 0  # their state, float32, all such layers
    weight_bytes_override: float | None = None  # measured bytes of the loaded weights (a file's own formats), if known

    # ---- counts ----------------------------------------------------------------------------
    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> float:
        return sum(l.params for l in self.linears_total) + self.small_params + self.embed_params * (1 if self.tied else 2)

    @property
    def active_params(self) -> float:
        """Activated parameters as model cards count them: all but the experts a token does not use
        (embedding table and LM head included)."""
        return sum(l.params for l in self.linears_active) + self.small_params + self.embed_params * (1 if self.tied else 2)

    def weight_bytes(self, fmt: str) -> float:
        """Bytes of all weights (what must fit in memory)."""
        if self.weight_bytes_override is not None:
            return self.weight_bytes_override
        return self._bytes(self.linears_total, fmt) + 2 * (self.small_params + self.embed_params * (1 if self.tied else 2))

    def step_weight_bytes(self, fmt: str, batch: int = 1) -> float:
        """Bytes one decode step reads: the active linears (for MoE, the experts a batch of this size
        touches), norms, and the LM head (the embedding table is only looked up)."""
        linears = self.linears_active if not self.is_moe else self._moe_linears_for_batch(batch)
        return self._bytes(linears, fmt) + 2 * (self.small_params + self.embed_params)

    def kv_bytes_per_token(self, fmt: str) -> float:
        """KV bytes each further token of a sequence adds once it is past the window: those of the layers that
        keep every token (every layer, without sliding windows)."""
        return (self.num_layers - self.window_layers - self.state_layers) * self.kv_elems_per_token_per_layer * (1 if fmt in ("fp8", "int8") else 2)

    def kv_bytes(self, tokens: int, fmt: str) -> float:
        """KV bytes of one sequence of `tokens` tokens: every token in the full-attention layers, the last
        `window` in each sliding layer, and the fixed recurrent state of the Mamba-2 layers."""
        per_layer_token = self.kv_elems_per_token_per_layer * (1 if fmt in ("fp8", "int8") else 2)
        full = self.num_layers - self.window_layers - self.state_layers
        return per_layer_token * (full * tokens + self.window_layers * min(tokens, self.window)) + self.state_bytes_per_sequence

    def flops_per_token(self, context: int) -> float:
        """Forward FLOPs for one token at `context`: 2 per weight of every matmul it goes through
        (active linears and the LM head; the embedding lookup is free) + attention over the context
        (over the window in a sliding layer)."""
        seen = (self.num_layers - self.window_layers - self.state_layers) * context + self.window_layers * min(context, self.window)
        attn = 4 * seen * self.num_heads * self.head_dim  # q.k and p.v
        return 2 * (sum(l.params for l in self.linears_active) + self.embed_params) + attn

    # ---- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _bytes(linears: list[LinearShape], fmt: str) -> float:
        total = 0.0
        for l in linears:
            if fmt in ("fp16", "bf16"):
                total += 2 * l.params
            elif fmt in ("fp8", "int8", "w8a8"):  # one byte a weight + a 16-bit scale per output channel
                total += l.params + 2 * l.out_features * l.count
            elif fmt == "int4":  # half a byte a weight + per group of 128: 16-bit scale and 4-bit zero point
                groups = l.out_features * -(-l.in_features // INT4_GROUP) * l.count
                total += l.params / 2 + groups * 2.5
            else:
                raise ValueError(f"unknown weight format {fmt!r}; use one of {', '.join(WEIGHT_FORMATS)}")
        return total

    def _moe_linears_for_batch(self, batch: int) -> list[LinearShape]:
        """Expected experts touched by `batch` tokens routed uniformly: E * (1 - (1 - k/E)^batch)."""
        out = []
        for l in self.linears_total:
            if getattr(l, "experts", None):
                e, k = l.experts  # type: ignore[attr-defined]
                touched = e * (1 - (1 - k / e) ** batch)
                out.append(LinearShape(l.out_features, l.in_features, l.count / e * touched))
            else:
                out.append(l)
        return out


@dataclass(frozen=True)
class ExpertShape(LinearShape):
    experts: tuple[int, int] = (1, 1)  # (experts in this group, experts a token uses)


def shape_from_config(cfg: dict, name: str = "model") -> ModelShape:
    if "text_config" in cfg:  # multimodal wrappers: plan the language model
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    H = cfg["num_attention_heads"]
    kvh = cfg.get("num_key_value_heads") or H
    vocab = cfg["vocab_size"]
    tied = bool(cfg.get("tie_word_embeddings", False))
    arch = " ".join(cfg.get("architectures") or [cfg.get("model_type", "")])
    gemma = "Gemma3" in arch or cfg.get("model_type") in ("gemma3", "gemma3_text")
    small = L * (4 if gemma else 2) * h + h  # two norms per layer (Gemma: four) + final norm
    attn: list[LinearShape] = []
    is_mla = "kv_lora_rank" in cfg and cfg.get("kv_lora_rank")
    if is_mla:  # DeepSeek V2/V3 multi-head latent attention
        r_kv, rope, nope, v = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        q_lora = cfg.get("q_lora_rank")
        qk = nope + rope
        if q_lora:
            attn += [LinearShape(q_lora, h), LinearShape(H * qk, q_lora)]
            small += L * q_lora
        else:
            attn += [LinearShape(H * qk, h)]
        attn += [LinearShape(r_kv + rope, h), LinearShape(H * (nope + v), r_kv), LinearShape(h, H * v)]
        small += L * r_kv
        head_dim, kv_elems = qk, r_kv + rope  # the cache holds the latent and the shared rope key
    else:
        d = cfg.get("head_dim") or h // H
        attn += [LinearShape(H * d, h), LinearShape(kvh * d, h), LinearShape(kvh * d, h), LinearShape(h, H * d)]
        if "Qwen2" in arch or cfg.get("attention_bias"):
            small += L * (H * d + 2 * kvh * d)  # q/k/v bias
        if "Qwen3" in arch or gemma:
            small += L * 2 * d  # q/k norms
        head_dim, kv_elems = d, 2 * kvh * d

    total: list[LinearShape] = []
    active: list[LinearShape] = []
    is_moe = False
    n_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    top_k = cfg.get("num_experts_per_tok")
    dense_layers = set()
    if n_experts and top_k:
        is_moe = True
        first_dense = cfg.get("first_k_dense_replace", 0)
        step = cfg.get("decoder_sparse_step", 1) or 1
        only_mlp = set(cfg.get("mlp_only_layers") or [])
        dense_layers = {i for i in range(L) if i < first_dense or i in only_mlp or (i + 1) % step != 0}
    mamba = _mamba(cfg, arch, h, L)
    for i in range(L):
        if i in mamba["layers"]:  # a Mamba-2 mixer in place of attention
            total += mamba["linears"]
            active += mamba["linears"]
            small += mamba["small"]
        else:
            total += attn
            active += attn
        if i in dense_layers or not is_moe:
            inter = cfg["intermediate_size"]
            mlp = [LinearShape(inter, h), LinearShape(inter, h), LinearShape(h, inter)]
            total += mlp
            active += mlp
            continue
        e_inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        for o, n in ((e_inter, h), (e_inter, h), (h, e_inter)):
            total.append(ExpertShape(o, n, n_experts, experts=(n_experts, top_k)))
            active.append(LinearShape(o, n, top_k))
        total.append(LinearShape(n_experts, h))  # router
        active.append(LinearShape(n_experts, h))
        shared = cfg.get("shared_expert_intermediate_size") or (
            (cfg.get("n_shared_experts") or 0) * e_inter if cfg.get("n_shared_experts") else 0)
        if shared:
            sh = [LinearShape(shared, h), LinearShape(shared, h), LinearShape(h, shared)]
            total += sh
            active += sh
            if cfg.get("shared_expert_intermediate_size"):
                small += h  # Qwen-MoE's shared-expert gate
    windows = _windows(cfg, arch)
    sliding = [w for w in windows if w is not None]
    return ModelShape(name, L, h, H, head_dim, vocab, tied, kv_elems, total, active, small, is_moe, bool(is_mla),
                      len(sliding), max(sliding, default=0), len(mamba["layers"]), mamba["state_bytes"])


def _mamba(cfg: dict, arch: str, h: int, L: int) -> dict:
    """Bamba's Mamba-2 layers: their linears (in_proj, out_proj), small parameters (depthwise conv, dt_bias, A_log,
    D, the gated norm) and the recurrent state of a sequence (float32), by the rule the engine reads the config with."""
    if "Bamba" not in arch:
        return {"layers": set(), "linears": [], "small": 0, "state_bytes": 0}
    from sieve.models.arch import ModelArch

    a = ModelArch.from_hf_config({**cfg, "architectures": ["BambaForCausalLM"]})
    inner, conv, heads = a.mamba_intermediate, a.mamba_conv_dim, a.mamba_n_heads
    small = conv * a.mamba_d_conv + (conv if a.mamba_conv_bias else 0) + 3 * heads + inner
    return {"layers": set(a.mamba_layers), "linears": [LinearShape(inner + conv + heads, h), LinearShape(h, inner)],
            "small": small, "state_bytes": a.state_bytes_per_sequence()}


def _windows(cfg: dict, arch: str) -> tuple[int | None, ...]:
    """Each layer's sliding window, by the rule the engine loads the config with (sieve/models/arch.py)."""
    from sieve.models.arch import SUPPORTED_ARCHITECTURES, layer_windows

    name = next((a for a in arch.split() if a in SUPPORTED_ARCHITECTURES), arch)
    sliding = cfg.get("sliding_window")
    if "Qwen" in name and not cfg.get("use_sliding_window", False):
        sliding = None
    return layer_windows(name, cfg, sliding)
