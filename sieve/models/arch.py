"""What the decoder needs from a Hugging Face `config.json`, for every architecture we support.

The four supported families differ only in a handful of switches (q/k/v bias, q/k RMSNorm,
explicit head_dim, rope scaling), so one decoder serves them all.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


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
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (supported: silu)")
        qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        moe = _moe_fields(arch, cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # transformers >= 5 writes `rope_parameters`; released checkpoints use rope_theta / rope_scaling.
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        sliding = cfg.get("sliding_window")
        if qwen2 or qwen3:
            sliding = sliding if cfg.get("use_sliding_window", False) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=True if qwen2 else bool(cfg.get("attention_bias", False)),
            o_bias=False if qwen2 else bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qwen3,
            hidden_act=act,
            sliding_window=sliding,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            eos_token_ids=eos_ids,
            **moe,
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # ---- sizes the rest of the engine plans with ---------------------------------------
    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _moe_fields(arch: str, cfg: dict) -> dict:
    """Mixtral: every layer sparse, top-k weights renormalised. Qwen2-MoE / Qwen3-MoE: layer i is sparse when
    (i + 1) % decoder_sparse_step == 0 and it is not in mlp_only_layers (those keep a dense MLP of
    intermediate_size); Qwen2-MoE adds a shared expert behind a sigmoid gate."""
    layers = cfg["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True, sparse_layers=tuple(range(layers)))
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 writes Qwen3-MoE's as the latter
        return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["moe_intermediate_size"],
                    shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0,
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    sparse_layers=tuple(i for i in range(layers) if (i + 1) % step == 0 and i not in dense))
    return {}
