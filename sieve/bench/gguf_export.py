"""Write a checkpoint as a GGUF file for llama.cpp, with the `gguf` package.

For the side-by-side benchmark and the tests: the same weights, converted here, so both engines serve
one checkpoint.
  - `export_gguf`: a Hugging Face checkpoint (Llama, Mistral, Qwen2, Qwen3) in f32, f16, bf16, q8_0,
    q4_0 or q4_1 (1-D tensors stay f32, as llama.cpp's own converter does). A byte-level BPE
    tokenizer (`tokenizer.json` with a vocabulary and merges) is written as llama.cpp's "gpt2" model;
    a SentencePiece one (`tokenizer.model`) as its "llama" model.
  - `reencode_gguf`: a GGUF file in another of those types (every 2-D tensor dequantized and encoded
    again; metadata copied), e.g. the f16 and q8_0 exports of a Q4_1 file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from sieve.models.gguf import LAYER_NAMES, TOP_NAMES

ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
QTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")


def gguf_name(hf: str) -> str | None:
    if hf in TOP_NAMES:
        return TOP_NAMES[hf]
    parts = hf.split(".")
    if parts[:2] == ["model", "layers"]:
        suffix = ".".join(parts[3:])
        if suffix in LAYER_NAMES:
            return f"blk.{parts[2]}.{LAYER_NAMES[suffix]}"
    return None


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
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
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    if model.get("type") == "BPE" and "merges" in model and not (path / "tokenizer.model").exists():
        vocab = dict(model["vocab"])
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
    elif (path / "tokenizer.model").exists():
        _add_sentencepiece(writer, path / "tokenizer.model", vocab_size)
    else:
        raise ValueError(f"{path}: only byte-level BPE (tokenizer.json) and SentencePiece (tokenizer.model) tokenizers "
                         f"convert (found {model.get('type')})")
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is not None:
        writer.add_eos_token_id(int(eos))
    if cfg.get("bos_token_id") is not None:
        writer.add_bos_token_id(int(cfg["bos_token_id"]))
    tk_cfg = path / "tokenizer_config.json"
    tk = json.loads(tk_cfg.read_text()) if tk_cfg.exists() else {}
    writer.add_add_bos_token(bool(tk.get("add_bos_token", (path / "tokenizer.model").exists())))  # as the source tokenizer does
    template = tk.get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    if isinstance(template, str):
        writer.add_chat_template(template)


def _add_sentencepiece(writer, model_file: Path, vocab_size: int) -> None:
    """llama.cpp's "llama" tokenizer model: the SentencePiece pieces, scores and types, as its converter writes them."""
    import gguf
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(model_file))
    tokens, scores, types = [], [], []
    for i in range(vocab_size):
        if i >= sp.vocab_size():
            tokens.append(f"[PAD{i}]".encode())
            scores.append(-1000.0)
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(sp.id_to_piece(i).encode("utf-8"))
        scores.append(sp.get_score(i))
        types.append(gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
                     else gguf.TokenType.UNUSED if sp.is_unused(i) else gguf.TokenType.BYTE if sp.is_byte(i)
                     else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(sp.unk_id())


_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0",
               "q4_1": "MOSTLY_Q4_1"}


def _encode(writer, name: str, data: np.ndarray, qtype: str) -> None:
    """Add a float32 tensor as `qtype` (1-D tensors stay f32, as llama.cpp's converter keeps them)."""
    import gguf

    if data.ndim == 1 or qtype == "f32":
        writer.add_tensor(name, data.astype(np.float32))
    elif qtype == "f16":
        writer.add_tensor(name, data.astype(np.float16))
    else:
        t = getattr(gguf.GGMLQuantizationType, qtype.upper())  # bytes in, the writer derives the element shape
        writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), t), raw_dtype=t)


def _check_qtype(qtype: str) -> None:
    if qtype not in QTYPES:
        raise ValueError(f"GGUF export writes {', '.join(QTYPES)}, not {qtype}")


def export_gguf(path: str | Path, out: str | Path, qtype: str = "f16", log=print) -> Path:
    """Convert the checkpoint at `path` to `out` in `qtype`; returns `out`."""
    import gguf

    path, out = Path(path), Path(out)
    _check_qtype(qtype)
    cfg = json.loads((path / "config.json").read_text())
    arch_name = (cfg.get("architectures") or ["?"])[0]
    if arch_name not in ARCH:
        raise ValueError(f"GGUF export supports {sorted(ARCH)}, not {arch_name}")
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
    writer.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPES[qtype]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(writer, path, cfg["vocab_size"], cfg)
    if rope_type == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, theta, head_dim))

    for hf_name, t in _tensors(path):
        name = gguf_name(hf_name)
        if name is None:
            if "rotary_emb" in hf_name:
                continue
            raise ValueError(f"{path}: no GGUF name for tensor {hf_name}")
        data = t.to(torch.float32).numpy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = unpermute_rope(data, n_head if "attn_q" in name else n_kv)
        _encode(writer, name, data, qtype)
    _finish(writer, tmp, out)
    log(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB, {qtype})")
    return out


def reencode_gguf(src: str | Path, out: str | Path, qtype: str, log=print, encode=None) -> Path:
    """The GGUF file `src` with every 2-D tensor dequantized and encoded as `qtype`, metadata copied.
    `encode(name, float32 data)` may return (raw bytes, GGMLQuantizationType) to store a tensor otherwise."""
    import gguf

    _check_qtype(qtype)
    src, out = Path(src), Path(out)
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPES[qtype]))
    for t in reader.tensors:
        data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
        custom = encode(t.name, data) if encode is not None else None
        if custom is not None:
            writer.add_tensor(t.name, custom[0], raw_dtype=custom[1])
        else:
            _encode(writer, t.name, data, qtype)
    _finish(writer, tmp, out)
    log(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {qtype}, from {src.name})")
    return out


def _finish(writer, tmp: Path, out: Path) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    tmp.replace(out)
