"""Random-weight checkpoints shaped like published models, for benchmarks (no hub needed)."""

from __future__ import annotations

import json
from pathlib import Path

# Published config values of Qwen/Qwen2.5-0.5B (config.json on the hub).
QWEN25_05B = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, intermediate_size=4864,
    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, vocab_size=151936,
    bos_token_id=151643, eos_token_id=151643, hidden_act="silu", use_sliding_window=False, sliding_window=32768,
    max_window_layers=24, torch_dtype="bfloat16",
)
# Published config values of meta-llama/Llama-3.2-1B (config.json on the hub): no biases, llama3-scaled rotary.
LLAMA32_1B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
    rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
    rms_norm_eps=1e-5, tie_word_embeddings=True, vocab_size=128256, bos_token_id=128000, eos_token_id=128001,
    hidden_act="silu", attention_bias=False, mlp_bias=False, torch_dtype="bfloat16",
)
# Published config values of HuggingFaceTB/SmolLM2-135M-Instruct: the default model's shape, for a GPU machine that
# cannot take the GGUF file along (a decode step's time is its shape's, not its weights').
SMOLLM2_135M = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, vocab_size=49152, bos_token_id=1, eos_token_id=2,
    hidden_act="silu", attention_bias=False, mlp_bias=False, torch_dtype="bfloat16",
)
SHAPES = {"qwen2.5-0.5b": QWEN25_05B, "llama-3.2-1b": LLAMA32_1B, "smollm2-135m": SMOLLM2_135M}


def add_tokenizer(path: Path, cfg: dict) -> None:
    """A byte-level BPE with the checkpoint's full vocabulary, trained on the standard library's source
    (so text in and out of a server is real text, and llama.cpp can take the same vocabulary). Its own
    special tokens (ids 0-2) replace the published BOS/EOS ids in config.json."""
    from sieve.demo import stdlib_bpe_tokenizer

    tok = stdlib_bpe_tokenizer(cfg["vocab_size"], corpus_bytes=80_000_000, recursive=True)
    tok.save_pretrained(path)
    cfg.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def make_random_checkpoint(path: Path, shape: str = "qwen2.5-0.5b", seed: int = 0, tokenizer: bool = True,
                           std: float = 0.02) -> Path:
    """Write config.json + model.safetensors with seeded random weights (std `std`) in the config's dtype,
    and (unless `tokenizer=False`) a tokenizer with the full vocabulary; a folder that has the weights
    but no tokenizer gets one, and one that has the tokenizer (with its config) keeps its token ids."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    cfg = dict(SHAPES[shape])
    if (path / "tokenizer.json").exists() and (path / "config.json").exists():  # a tokenizer carried ahead of the weights
        written = json.loads((path / "config.json").read_text())
        cfg.update(bos_token_id=written["bos_token_id"], eos_token_id=written["eos_token_id"])
    if (path / "model.safetensors").exists():
        if tokenizer and not (path / "tokenizer.json").exists():
            add_tokenizer(path, cfg)
        return path
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg["torch_dtype"])
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    bias = cfg["model_type"] == "qwen2"  # Qwen2's q/k/v carry biases; Llama's nothing

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    tensors = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rnd(v, h)
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
            p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h), p + "mlp.down_proj.weight": rnd(h, i),
        })
        if bias:
            tensors.update({p + "self_attn.q_proj.bias": rnd(q), p + "self_attn.k_proj.bias": rnd(kv),
                            p + "self_attn.v_proj.bias": rnd(kv)})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer:
        add_tokenizer(path, cfg)
    return path


def main(argv: list[str] | None = None) -> None:
    """`python -m sieve.bench.checkpoints SHAPE DIR [--no-tokenizer] [--tokenizer-only]`: write a random checkpoint
    (or only its tokenizer, to carry to a machine that writes the weights itself)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m sieve.bench.checkpoints")
    p.add_argument("shape", choices=list(SHAPES))
    p.add_argument("path")
    p.add_argument("--no-tokenizer", action="store_true")
    p.add_argument("--tokenizer-only", action="store_true")
    a = p.parse_args(argv)
    path = Path(a.path)
    if a.tokenizer_only:
        path.mkdir(parents=True, exist_ok=True)
        add_tokenizer(path, dict(SHAPES[a.shape]))
        return
    make_random_checkpoint(path, a.shape, tokenizer=not a.no_tokenizer)


if __name__ == "__main__":
    main()
