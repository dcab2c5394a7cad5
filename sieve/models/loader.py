"""Find a checkpoint (a Hugging Face folder or hub id, or a GGUF file), read its config, build the
decoder, load its weights.

`open_checkpoint` gives one interface over both kinds: `.config` (config.json-shaped), `.tensors()`
((Hugging Face name, value) pairs), `.tokenizer()`, `.quantization`.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open

from sieve.device import available_memory_bytes
from sieve.models.arch import ModelArch, UnsupportedModelError
from sieve.models.decoder import DecoderModel
from sieve.models.gguf import GGUFCheckpoint, find_gguf

log = logging.getLogger("sieve")

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local folder or GGUF file as is; anything else is taken for a Hugging Face hub id and downloaded."""
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and find_gguf(path) is not None):
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.endswith(".gguf"):
        raise FileNotFoundError(f"model path {model!r} is neither a folder holding a checkpoint nor a GGUF file")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(
            model, revision=revision,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken"],
        ))
    except Exception as e:  # no network, unknown repo, gated repo...
        raise FileNotFoundError(f"could not find {model!r} locally or download it from the hub: {e}") from e


def read_config(path: Path) -> dict:
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return GGUFCheckpoint(gguf_file).config
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no config.json (nor a GGUF file)")
    return json.loads(cfg_file.read_text())


class HFCheckpoint:
    """A Hugging Face folder: config.json, safetensors (single or sharded), tokenizer files."""

    def __init__(self, path: Path):
        self.path = path
        self.config = read_config(path)
        self.quantization, self.group_size = checkpoint_quantization(self.config)

    def tensors(self):
        """(name, tensor) pairs; a W8A8 checkpoint's quantized linears come as one W8A8 weight each (its `weight`
        and `weight_scale`, wherever the shards keep them)."""
        files = safetensors_files(self.path)
        if self.quantization != "w8a8":
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            return
        from contextlib import ExitStack

        from sieve.quant.compressed_tensors import from_tensors

        with ExitStack() as stack:
            handles = [stack.enter_context(safe_open(str(file), framework="pt", device="cpu")) for file in files]
            where = {name: h for h in handles for name in h.keys()}
            for name, h in where.items():
                if name.endswith(".weight_scale"):
                    continue
                scale = name.removesuffix(".weight") + ".weight_scale" if name.endswith(".weight") else None
                if scale in where:
                    yield name, from_tensors(name.removesuffix(".weight"), h.get_tensor(name), where[scale].get_tensor(scale))
                else:
                    yield name, h.get_tensor(name)

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path))

    def describe(self) -> str:
        return f"{self.path} (safetensors)"


def open_checkpoint(model: str, revision: str | None = None, dequantize: bool = False) -> HFCheckpoint | GGUFCheckpoint:
    path = resolve_model_path(model, revision)
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return GGUFCheckpoint(gguf_file, dequantize)
    if dequantize and checkpoint_quantization(read_config(path))[0] is None:
        log.info("--dequantize: %s holds no quantized weights", path)
    return HFCheckpoint(path)


def resolve_dtype(dtype: str, arch: ModelArch, device: torch.device | None = None) -> torch.dtype:
    if dtype == "auto":
        name = arch.torch_dtype or "float32"
        resolved = _DTYPES.get(name, torch.float32)
        if resolved == torch.float16 and (device is None or device.type == "cpu"):
            # as vLLM does on CPU: float16 has no fast arithmetic here, bfloat16 has the same size and more range
            log.info("the checkpoint's dtype is float16; on CPU sieve runs it in bfloat16 (pass --dtype float16 to insist)")
            return torch.bfloat16
        return resolved
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
    """('awq', group size) for an AWQ checkpoint, ('w8a8', None) for llm-compressor's W8A8 (compressed-tensors), (None,
    None) for an unquantized one; UnsupportedModelError for any other."""
    qc = config.get("quantization_config")
    if not qc:
        return None, None
    method = qc.get("quant_method")
    if method == "awq" and qc.get("bits", 4) == 4 and qc.get("version", "gemm").lower() == "gemm":
        return "awq", int(qc.get("group_size", 128))
    if method == "compressed-tensors":
        from sieve.quant.compressed_tensors import check_config

        check_config(qc)
        return "w8a8", None
    raise UnsupportedModelError(f"checkpoint quantization {qc!r} is not supported: sieve loads AWQ 4-bit 'gemm' and "
                                "compressed-tensors W8A8 checkpoints")


def load_model(ckpt: HFCheckpoint | GGUFCheckpoint, arch: ModelArch, dtype: torch.dtype, device: torch.device, max_positions: int,
               quantization: str | None = None, group_size: int = 128, quantize_lm_head: bool = False, tp=None,
               greedy_head: bool = True) -> DecoderModel:
    """The model `arch` describes, with its weights. With `tp` (a sieve.distributed TensorParallelGroup of more than one
    rank), this rank's shard: its heads, MLP channels and vocabulary slice of the head, cut from each tensor as it is read."""
    if ckpt.quantization is not None:
        if quantization not in (None, ckpt.quantization):
            hint = " (--dequantize widens it first)" if ckpt.quantization == "gguf" else ""
            raise ValueError(f"{ckpt.path} is already quantized ({ckpt.quantization}); it cannot be loaded as {quantization}{hint}")
        if ckpt.quantization == "awq":
            quantization, group_size = "awq", ckpt.group_size
    if tp is not None:
        from sieve.distributed.shard import check_shardable, shard_arch, shard_tensor

        check_shardable(arch, tp.world_size)
    with torch.device(device):
        model = DecoderModel(shard_arch(arch, tp.world_size) if tp is not None else arch, dtype, max_positions, tp)
    loaded: set[str] = set()
    for name, tensor in ckpt.tensors():
        is_awq = name.endswith((".qweight", ".qzeros", ".scales"))
        if tp is not None:
            tensor = shard_tensor(name, tensor, arch, tp)
        if not isinstance(tensor, torch.Tensor):  # a quantized weight: kept in its format
            tensor = tensor.to(device)
        elif is_awq:
            tensor = tensor.to(device=device)
        else:
            tensor = tensor.to(device=device, dtype=dtype)
        if model.load_weight(name, tensor):
            loaded.add(name.replace(".qweight", ".weight") if is_awq else name)
    expected = _expected_names(arch)
    missing = sorted(expected - {n.removeprefix("model.") for n in loaded})
    if missing:
        raise ValueError(f"checkpoint at {ckpt.path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    # A second weight layout (plain for decode GEMV + packed for batches) only where memory is ample.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    two_layouts = quantization is None and 2 * weight_bytes < 0.4 * available_memory_bytes(device)
    model.prepare(allow_two_layouts=two_layouts, quantization=None if quantization == "gguf" else quantization,
                  group_size=group_size, quantize_lm_head=quantize_lm_head, greedy_head=greedy_head)
    log.info("loaded %s: %s", ckpt.describe(), describe_kernels(model))
    warn_slow_kernels(model, device)
    return model.eval()


def warn_slow_kernels(model: DecoderModel, device: torch.device) -> None:
    """A weight format with no fast path here widens its whole matrix on every call: say so, once per format."""
    from sieve.kernels import cpu_ops
    from sieve.layers.linear import Linear

    slow = {m.qkernel.name for m in model.modules() if isinstance(m, Linear) and getattr(m.qkernel, "widens", False)}
    if not slow:
        return
    where = f"this CPU ({cpu_ops().isa if cpu_ops() is not None else 'no native kernels'} build)" if device.type == "cpu" else str(device)
    for name in sorted(slow):
        log.warning("%s: no fast kernel on %s; every call widens the whole matrix, so decode can run ~90x slower "
                    "than bf16 weights (a 4864x896 matrix at one row: 24-28 ms against 0.27-0.33 ms)", name, where)


def describe_kernels(model: DecoderModel) -> str:
    """Which kernel runs which linear layers, e.g. '210 int4 g32 (native), 1 int8 g32 (native)'."""
    from sieve.layers.linear import Linear

    kinds: Counter = Counter()
    for m in model.modules():
        if isinstance(m, Linear):
            kinds[m.kernel_name()] += 1
    loop = "; layer loop: native (C++)" if model.native is not None else "; layer loop: Python"
    sketch = "" if model.greedy_head is None else (
        f"; greedy rows: {model.greedy_head.describe()}")
    return ", ".join(f"{n} linears {k}" for k, n in kinds.most_common()) + loop + sketch


def _expected_names(a: ModelArch) -> set[str]:
    names = {"embed_tokens.weight", "final_layernorm.weight" if a.mamba_layers else "norm.weight"}
    if not a.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(a.num_layers):
        p = f"layers.{i}."
        if i in a.mamba_layers or a.mamba_layers:  # Bamba: its names for the MLP and the norm before it
            names |= {p + "input_layernorm.weight", p + "pre_ff_layernorm.weight"}
            names |= {p + f"feed_forward.{m}_proj.weight" for m in ("gate", "up", "down")}
            if i in a.mamba_layers:
                names |= {p + f"mamba.{m}" for m in ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight",
                                                      "out_proj.weight")} | ({p + "mamba.conv1d.bias"} if a.mamba_conv_bias else set())
            else:
                names |= {p + f"self_attn.{m}_proj.weight" for m in "qkvo"}
            continue
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if a.is_mla:
            q = ("q_a_proj", "q_a_layernorm", "q_b_proj") if a.q_lora_rank else ("q_proj",)
            names |= {p + f"self_attn.{m}.weight" for m in q + ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")}
        else:
            names |= {p + f"self_attn.{m}_proj.weight" for m in "qkvo"}
        if i in a.sparse_layers:
            block = "block_sparse_moe" if a.architecture == "MixtralForCausalLM" else "mlp"
            projs = ("w1", "w3", "w2") if a.architecture == "MixtralForCausalLM" else ("gate_proj", "up_proj", "down_proj")
            names.add(p + f"{block}.gate.weight")
            names |= {p + f"{block}.experts.{e}.{m}.weight" for e in range(a.num_experts) for m in projs}
            if a.shared_expert_intermediate_size and not a.shared_expert_gated:  # DeepSeek: ungated shared experts
                names |= {p + f"mlp.shared_experts.{m}_proj.weight" for m in ("gate", "up", "down")}
            elif a.shared_expert_intermediate_size:
                names |= {p + f"mlp.shared_expert.{m}_proj.weight" for m in ("gate", "up", "down")} | {p + "mlp.shared_expert_gate.weight"}
        else:
            names |= {p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
        if a.qkv_bias:
            names |= {p + f"self_attn.{m}_proj.bias" for m in "qkv"}
        if a.qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        if a.gemma:
            names |= {p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"}
    return names


def default_num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
