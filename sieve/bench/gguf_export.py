"""Write a Hugging Face checkpoint (Llama, Mistral, Qwen2, Qwen3) as a GGUF file for llama.cpp.

Only for the side-by-side benchmark: the same weights, converted here with the `gguf` package
(optional extra `peers`), so both engines serve one checkpoint. Formats: f16 and q8_0 (1-D tensors
stay f32, as llama.cpp's own converter does). The tokenizer must be a byte-level BPE
(`tokenizer.json` with a vocabulary and merges), written as llama.cpp's "gpt2" tokenizer model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
LAYER_NAMES = {  # HF suffix -> GGUF name
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def _gguf_name(hf: str) -> str | None:
    if hf in TOP_NAMES:
        return TOP_NAMES[hf]
    parts = hf.split(".")
    if parts[:2] == ["model", "layers"]:
        suffix = ".".join(parts[3:])
        if suffix in LAYER_NAMES:
            return f"blk.{parts[2]}.{LAYER_NAMES[suffix]}"
    return None


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF Llama stores q/k rows for rotate-half rope; llama.cpp's "llama" arch wants interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp applies Llama 3.1 rope scaling as per-frequency divisors in a `rope_freqs` tensor."""
    factor, lo, hi = scaling.get("factor", 8.0), scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for wavelen in 2 * math.pi / freqs:
        if wavelen < old_ctx / hi:
            out.append(1.0)
        elif wavelen > old_ctx / lo:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _tensors(path: Path):
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def _add_tokenizer(writer, path: Path, vocab_size: int, cfg: dict) -> None:
    import gguf

    spec = json.loads((path / "tokenizer.json").read_text())
    model = spec["model"]
    if model.get("type") != "BPE" or "merges" not in model:
        raise ValueError(f"{path}: only byte-level BPE tokenizers convert (found {model.get('type')})")
    vocab = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab.update(special)
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):  # rows past the tokenizer's vocabulary become unused pad tokens
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if by_id[i] in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if cfg.get("model_type") in ("qwen2", "qwen3") else "gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is not None:
        writer.add_eos_token_id(int(eos))
    if cfg.get("bos_token_id") is not None:
        writer.add_bos_token_id(int(cfg["bos_token_id"]))
    writer.add_add_bos_token(False)
    tk_cfg = path / "tokenizer_config.json"
    template = json.loads(tk_cfg.read_text()).get("chat_template") if tk_cfg.exists() else None
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    if isinstance(template, str):
        writer.add_chat_template(template)


def export_gguf(path: str | Path, out: str | Path, qtype: str = "f16", log=print) -> Path:
    """Convert the checkpoint at `path` to `out` in f16 or q8_0; returns `out`."""
    import gguf

    path, out = Path(path), Path(out)
    cfg = json.loads((path / "config.json").read_text())
    arch_name = (cfg.get("architectures") or ["?"])[0]
    if arch_name not in ARCH:
        raise ValueError(f"GGUF export supports {sorted(ARCH)}, not {arch_name}")
    if qtype not in ("f16", "q8_0"):
        raise ValueError(f"GGUF export writes f16 or q8_0, not {qtype}")
    arch = ARCH[arch_name]
    h, n_head = cfg["hidden_size"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_head)
    head_dim = cfg.get("head_dim") or h // n_head
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"GGUF export handles default and llama3 rope, not {rope_type!r}")

    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_name(path.name)
    writer.add_context_length(cfg.get("max_position_embeddings", 4096))
    writer.add_embedding_length(h)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "q8_0" else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(writer, path, cfg["vocab_size"], cfg)
    if rope_type == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, theta, head_dim))

    for hf_name, t in _tensors(path):
        name = _gguf_name(hf_name)
        if name is None:
            if "rotary_emb" in hf_name:
                continue
            raise ValueError(f"{path}: no GGUF name for tensor {hf_name}")
        data = t.to(torch.float32).numpy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = _unpermute_rope(data, n_head if "attn_q" in name else n_kv)
        if data.ndim == 1:
            writer.add_tensor(name, data.astype(np.float32))
        elif qtype == "q8_0":
            q8 = gguf.GGMLQuantizationType.Q8_0  # bytes in, the writer derives the element shape
            writer.add_tensor(name, gguf.quants.quantize(data, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, data.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    tmp.replace(out)
    log(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB, {qtype})")
    return out
