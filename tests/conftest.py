"""Tiny random-initialised Hugging Face checkpoints, one per architecture sieve claims.

Weights are drawn wider than the usual init (std ~ 1/sqrt(fan_in)) so that greedy decoding
wanders over the vocabulary instead of repeating one token, which makes parity tests bite.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _user_kernel_cache() -> Path | None:
    from sieve.demo import cache_root

    path = cache_root() / "kernels"  # read before the session sets its own SIEVE_CACHE (the `demo_dir` fixture)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None  # unwritable: they build in the session's SIEVE_CACHE


# Each session gets a fresh SIEVE_CACHE (demo model, tokenizers), but the native kernels keep building in the user's
# cache: they are keyed by their sources, this CPU and the instruction set, and compiling them takes minutes here.
if "SIEVE_KERNEL_CACHE" not in os.environ and (_kernels := _user_kernel_cache()) is not None:
    os.environ["SIEVE_KERNEL_CACHE"] = str(_kernels)

# ../shared beside the checkout; SIEVE_SHARED names a copy where it is not there (the device machine: scripts/gpu_prepare.sh)
SHARED = Path(os.environ.get("SIEVE_SHARED") or Path(__file__).resolve().parents[1].parent / "shared")


def cpu_flags() -> set[str]:
    """This CPU's feature flags, as /proc/cpuinfo lists them (empty where there is none)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return set(next((line for line in text.splitlines() if line.startswith("flags")), ":").split(":", 1)[1].split())

BASE = dict(
    hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, rms_norm_eps=1e-5, vocab_size=4096, bos_token_id=0, eos_token_id=2,
)
ARCHS = {
    # Llama 3.1 style: GQA, llama3 rope scaling, untied head
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(
        rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None)),
    # Qwen2: q/k/v bias, tied embeddings
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    # Qwen3: q/k RMSNorm, head_dim (32) != hidden / heads (16)
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(rope_theta=1000000.0, tie_word_embeddings=True, head_dim=32)),
}


def _widen_init(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    # With tied embeddings a large embedding makes every token predict itself; keep it small.
    tied = model.config.tie_word_embeddings
    embed_std, out_scale = (0.05, 3.0) if tied else (1.0, 1.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(embed_std * torch.randn(p.shape, generator=g))
            else:
                scale = out_scale if ("o_proj" in name or "down_proj" in name) else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def make_checkpoint(path: Path, arch: str, tokenizer_dir: Path, seed: int = 0, **save_kwargs) -> Path:
    import transformers

    cls_name, cfg_name, extra = ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(**BASE, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg).to(torch.float32)
    _widen_init(model, seed)
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    os.environ["SIEVE_CACHE"] = str(tmp_path_factory.mktemp("sieve-cache"))
    from sieve.demo import demo_model_path

    return demo_model_path()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, demo_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(root / arch, arch, demo_dir, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """stories260K, a tiny trained llama (grouped-query attention) in ../shared: for statistical and quantization tests."""
    path = SHARED / "models" / "stories260K"
    if not path.exists():
        pytest.fail(f"{path} is missing: ../shared holds the real checkpoint these tests measure")
    return path


@pytest.fixture(scope="session")
def llama_dir(checkpoints) -> Path:
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def llama_engine_factory(llama_dir):
    """Build LLM objects on the shared llama checkpoint with given engine options."""
    from sieve import LLM

    def make(**kwargs):
        kwargs.setdefault("num_gpu_blocks_override", 512)
        kwargs.setdefault("device", "cpu")
        return LLM(str(llama_dir), dtype="float32", **kwargs)

    return make


@pytest.fixture(scope="session")
def llama_llm(llama_engine_factory):
    return llama_engine_factory()


@pytest.fixture(scope="module")
def llama_server(llama_dir):
    """The tiny llama checkpoint served on a free port of 127.0.0.1, keyed with live_server.API_KEY, as
    live_server.MODEL: (base url, engine)."""
    from live_server import start_server
    from sieve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=256, max_model_len=512))
    url, stop = start_server(engine)
    yield url, engine
    stop()


@pytest.fixture(scope="module")
def smollm2_server():
    """The default model (SmolLM2-135M-Instruct) served on a free port of 127.0.0.1, keyed with live_server.API_KEY,
    as live_server.SMOLLM2: (base url, engine)."""
    from live_server import SMOLLM2, start_server
    from sieve import EngineConfig, LLMEngine
    from sieve.models.default import default_model_path

    engine = LLMEngine(EngineConfig(model=str(default_model_path()), kv_cache_memory_gb=0.5, max_model_len=2048))
    url, stop = start_server(engine, served_model_name=SMOLLM2)
    yield url, engine
    stop()
