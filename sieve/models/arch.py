"""What the decoder needs from a Hugging Face `config.json`, for every architecture we support.

The supported families differ only in a handful of switches (q/k/v bias, q/k RMSNorm, explicit
head_dim, rope scaling, experts; Gemma 3's sandwich norms, scaled embedding, GeGLU and sliding-window
layers), so one decoder serves them all.

Sliding-window attention is per layer: `layer_windows[i]` is layer i's window W (a query at position p
sees keys p - W < k <= p, as transformers masks it) or None for full attention. Mistral-style models
slide on every layer, Qwen2 on the layers from `max_window_layers` on (with use_sliding_window), Gemma 3
on five layers of six (`layer_types`), whose rotary base is then `rope_local_theta`.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM",
                           "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "BambaForCausalLM")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    # Mixture of experts (0 experts: dense): routed experts per token, their and the shared expert's MLP width,
    # whether the top-k routing weights are renormalised, and which layers are sparse.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    # Sliding windows and Gemma 3 (defaults: the Llama family).
    layer_windows: tuple[int | None, ...] = ()  # per layer: its attention window, None for full attention
    rope_local_theta: float | None = None  # rotary base of the sliding layers, where it differs (Gemma 3)
    gemma: bool = False  # RMSNorm scales by (1 + w), embeddings times sqrt(hidden), norms around attention and MLP
    attn_scale: float | None = None  # softmax scale when not head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    final_logit_softcapping: float | None = None
    # DeepSeek: multi-head latent attention (kv_lora_rank > 0: the cache holds the latent and the shared rope key per
    # token, one "head" of kv_lora_rank + qk_rope_head_dim), and its router (sigmoid scores, a correction bias,
    # group-limited top-k, a scaling factor; shared experts without a gate)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    moe_scoring: str = "softmax"
    moe_group_score: str = ""  # how a group of experts is scored for group-limited routing: "top2sum" (V3) or "max" (V2)
    moe_n_group: int = 1
    moe_topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True
    # Mamba-2 hybrids (Bamba): the layers that are Mamba-2 mixers (a per-sequence recurrent state instead of KV),
    # their sizes, and the share of each attention head's dims that rotary rotates
    mamba_layers: tuple[int, ...] = ()
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_n_groups: int = 1
    mamba_d_state: int = 0
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArch":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"sieve supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        mla = _mla_fields(arch, cfg)
        mamba = _mamba_fields(arch, cfg)
        gemma = arch == "Gemma3ForCausalLM"
        act = cfg.get("hidden_activation" if gemma else "hidden_act") or cfg.get("hidden_act") or "silu"
        if act not in ("silu", "swish", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (supported: silu, gelu_pytorch_tanh)")
        if cfg.get("attn_logit_softcapping") is not None:
            raise UnsupportedModelError("attn_logit_softcapping (Gemma 2) is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention is not supported: sieve serves causal decoders")
        qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        moe = _moe_fields(arch, cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # transformers >= 5 writes `rope_parameters`; released checkpoints use rope_theta / rope_scaling.
        rope = cfg.get("rope_parameters") or {}
        local_theta = None
        if gemma:  # one rope per layer type: full_attention (rope_theta, scaled) and sliding_attention (rope_local_base_freq)
            full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
            theta = cfg.get("rope_theta", full.get("rope_theta", 1_000_000.0))
            local_theta = cfg.get("rope_local_base_freq", local.get("rope_theta", 10_000.0))
            scaling = cfg.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
        else:
            scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
            theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        sliding = cfg.get("sliding_window")
        if qwen2 or qwen3:
            sliding = sliding if cfg.get("use_sliding_window", False) else None
        windows = layer_windows(arch, cfg, sliding)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=1 if mla else cfg.get("num_key_value_heads") or heads,
            head_dim=(mla["kv_lora_rank"] + mla["qk_rope_head_dim"]) if mla else cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=True if qwen2 else bool(cfg.get("attention_bias", False)),
            o_bias=False if qwen2 else bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qwen3 or gemma,
            hidden_act=act,
            sliding_window=sliding if any(windows) else None,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            eos_token_ids=eos_ids,
            **moe,
            layer_windows=windows,
            rope_local_theta=local_theta,
            gemma=gemma,
            attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            **mla,
            **mamba,
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def has_sliding_layers(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Layers that attend to the whole context (Mamba-2 layers do not attend: they keep no KV)."""
        return tuple(i for i in range(self.num_layers) if (not self.layer_windows or self.layer_windows[i] is None)
                     and i not in self.mamba_layers)

    @property
    def has_recurrent_state(self) -> bool:
        return bool(self.mamba_layers)

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_expand * self.hidden_size

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.mamba_n_groups * self.mamba_d_state

    def state_bytes_per_sequence(self, dtype_bytes: int = 4) -> int:
        """A sequence's recurrent state in all Mamba-2 layers: the convolution's last d_conv - 1 inputs and the SSM
        state (heads x head_dim x d_state), float32 as sieve keeps them."""
        per_layer = self.mamba_conv_dim * (self.mamba_d_conv - 1) + self.mamba_n_heads * self.mamba_d_head * self.mamba_d_state
        return len(self.mamba_layers) * per_layer * dtype_bytes

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.layer_windows and self.layer_windows[i] is not None)

    @property
    def max_window(self) -> int:
        return max((w for w in self.layer_windows if w is not None), default=0)

    # ---- sizes the rest of the engine plans with ---------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_entries(self) -> int:
        """Tensors cached per token and layer: K and V, or MLA's one (latent | rope key), read as both."""
        return 1 if self.is_mla else 2

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Every attention layer's K and V (Mamba-2 layers cache none)."""
        return self.kv_entries * (self.num_layers - len(self.mamba_layers)) * self.num_kv_heads * self.head_dim * dtype_bytes


def layer_windows(arch: str, cfg: dict, sliding: int | None) -> tuple[int | None, ...]:
    """Each layer's attention window (None: full attention), as transformers decides it per family."""
    layers = cfg["num_hidden_layers"]
    if not sliding:
        return (None,) * layers
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])
        if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
            raise UnsupportedModelError(f"layer_types {types!r} is not supported (one of full_attention, sliding_attention per layer)")
        return tuple(sliding if t == "sliding_attention" else None for t in types)
    if arch == "Gemma3ForCausalLM":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        return tuple(sliding if (i + 1) % pattern else None for i in range(layers))
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        first = int(cfg.get("max_window_layers", layers))
        return tuple(sliding if i >= first else None for i in range(layers))
    return (sliding,) * layers  # Mistral, Mixtral: every layer slides


def _mamba_fields(arch: str, cfg: dict) -> dict:
    if arch != "BambaForCausalLM":
        return {}
    layers = cfg["num_hidden_layers"]
    attn = set(cfg.get("attn_layer_indices") or [])
    if cfg.get("layers_block_type"):
        attn = {i for i, t in enumerate(cfg["layers_block_type"]) if t in ("attention", "full_attention")}
    heads, expand, hidden = cfg["mamba_n_heads"], cfg.get("mamba_expand", 2), cfg["hidden_size"]
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = expand * hidden // heads if d_head in (None, "auto") else int(d_head)
    if d_head * heads != expand * hidden:
        raise UnsupportedModelError(f"mamba_d_head x mamba_n_heads ({d_head} x {heads}) must equal mamba_expand x hidden_size")
    rope = cfg.get("rope_parameters") or {}
    limit = [_json_float(v) for v in (cfg.get("time_step_limit") or (0.0, float("inf")))]
    return dict(mamba_layers=tuple(i for i in range(layers) if i not in attn), mamba_n_heads=heads, mamba_d_head=d_head,
                mamba_n_groups=cfg.get("mamba_n_groups", 1), mamba_d_state=cfg["mamba_d_state"], mamba_d_conv=cfg.get("mamba_d_conv", 4),
                mamba_expand=expand, mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
                mamba_proj_bias=bool(cfg.get("mamba_proj_bias", False)), time_step_limit=(float(limit[0]), float(limit[1])),
                partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))))


def _json_float(v) -> float:
    """A float from config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def _mla_fields(arch: str, cfg: dict) -> dict:
    if arch not in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return {}
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise UnsupportedModelError(f"DeepSeek rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported "
                                    "(supported: default)")
    return dict(q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
                qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                # V2 rotates interleaved pairs (complex numbers); V3 says so in rope_interleave
                rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True)))


def _moe_fields(arch: str, cfg: dict) -> dict:
    """Mixtral: every layer sparse, top-k weights renormalised. Qwen2-MoE / Qwen3-MoE: layer i is sparse when
    (i + 1) % decoder_sparse_step == 0 and it is not in mlp_only_layers (those keep a dense MLP of
    intermediate_size); Qwen2-MoE adds a shared expert behind a sigmoid gate."""
    layers = cfg["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True, sparse_layers=tuple(range(layers)))
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        v3 = arch == "DeepseekV3ForCausalLM"
        method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
        if (v3 and (method != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid")) or \
                (not v3 and (method not in ("greedy", "group_limited_greedy") or cfg.get("scoring_func", "softmax") != "softmax")):
            raise UnsupportedModelError("DeepSeek routing: sieve runs V3's (sigmoid scores, noaux_tc group-limited top-k) and "
                                        "V2's (softmax scores, greedy or group_limited_greedy top-k)")
        grouped = method != "greedy"
        first, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1) or 1
        return dict(num_experts=cfg["n_routed_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["moe_intermediate_size"],
                    shared_expert_intermediate_size=(cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"],
                    # V2's router never renormalises its top-k weights (whatever norm_topk_prob says)
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) and v3, moe_scoring="sigmoid" if v3 else "softmax",
                    moe_group_score="top2sum" if v3 else "max",
                    moe_n_group=(cfg.get("n_group") or 1) if grouped else 1, moe_topk_group=(cfg.get("topk_group") or 1) if grouped else 1,
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)), shared_expert_gated=False,
                    sparse_layers=tuple(i for i in range(layers) if i >= first and i % freq == 0))
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 writes Qwen3-MoE's as the latter
        return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["moe_intermediate_size"],
                    shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0,
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    sparse_layers=tuple(i for i in range(layers) if (i + 1) % step == 0 and i not in dense))
    return {}
