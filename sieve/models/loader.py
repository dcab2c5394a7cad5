"""Find a checkpoint (local folder or hub id), read its config, build the decoder, load safetensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from sieve.device import available_memory_bytes
from sieve.models.arch import ModelArch
from sieve.models.decoder import DecoderModel

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local folder as is; anything else is taken for a Hugging Face hub id and downloaded."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path {model!r} is not a folder holding a Hugging Face checkpoint")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(
            model, revision=revision,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken"],
        ))
    except Exception as e:  # no network, unknown repo, gated repo...
        raise FileNotFoundError(f"could not find {model!r} locally or download it from the hub: {e}") from e


def read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no config.json")
    return json.loads(cfg_file.read_text())


def resolve_dtype(dtype: str, arch: ModelArch) -> torch.dtype:
    if dtype == "auto":
        name = arch.torch_dtype or "float32"
        return _DTYPES.get(name, torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    return files


def checkpoint_quantization(config: dict) -> tuple[str | None, int | None]:
    """('awq', group size) for an AWQ checkpoint, (None, None) for an unquantized one."""
    qc = config.get("quantization_config")
    if not qc:
        return None, None
    method = qc.get("quant_method")
    if method == "awq" and qc.get("bits", 4) == 4 and qc.get("version", "gemm").lower() == "gemm":
        return "awq", int(qc.get("group_size", 128))
    raise ValueError(f"checkpoint quantization {qc!r} is not supported: sieve loads AWQ 4-bit 'gemm' checkpoints")


def load_model(path: Path, arch: ModelArch, dtype: torch.dtype, device: torch.device, max_positions: int,
               quantization: str | None = None, group_size: int = 128, quantize_lm_head: bool = False) -> DecoderModel:
    ckpt_quant, ckpt_group = checkpoint_quantization(read_config(path))
    if ckpt_quant is not None:
        if quantization not in (None, ckpt_quant):
            raise ValueError(f"{path} is already quantized ({ckpt_quant}); it cannot be loaded as {quantization}")
        quantization, group_size = ckpt_quant, ckpt_group
    with torch.device(device):
        model = DecoderModel(arch, dtype, max_positions)
    loaded: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                is_awq = name.endswith((".qweight", ".qzeros", ".scales"))
                tensor = tensor.to(device=device) if is_awq else tensor.to(device=device, dtype=dtype)
                if model.load_weight(name, tensor):
                    loaded.add(name.replace(".qweight", ".weight") if is_awq else name)
    expected = _expected_names(arch)
    missing = sorted(expected - {n.removeprefix("model.") for n in loaded})
    if missing:
        raise ValueError(f"checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    # A second weight layout (plain for decode GEMV + packed for batches) only where memory is ample.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    two_layouts = quantization is None and 2 * weight_bytes < 0.4 * available_memory_bytes(device)
    model.prepare(allow_two_layouts=two_layouts, quantization=quantization, group_size=group_size,
                  quantize_lm_head=quantize_lm_head)
    return model.eval()


def _expected_names(a: ModelArch) -> set[str]:
    names = {"embed_tokens.weight", "norm.weight"}
    if not a.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(a.num_layers):
        p = f"layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{m}_proj.weight" for m in "qkvo"}
        names |= {p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
        if a.qkv_bias:
            names |= {p + f"self_attn.{m}_proj.bias" for m in "qkv"}
        if a.qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names


def default_num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
