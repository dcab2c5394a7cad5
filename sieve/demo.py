"""The built-in demo model: built here, deterministically, with no network.

A byte-level BPE tokenizer trained with `tokenizers` on the Python standard library's source (text
every machine with Python has) and a tiny Llama-architecture model with seeded random weights,
saved as an ordinary Hugging Face checkpoint under the user's cache folder. It exists so that
`sieve serve` and `sieve generate` work out of the box; its output is not meaningful text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import sysconfig
from pathlib import Path

log = logging.getLogger("sieve")

DEMO_VERSION = 1
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=688,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, vocab_size=VOCAB_SIZE,
    bos_token_id=0, eos_token_id=[0, 2], hidden_act="silu", torch_dtype="float32",
)


def _corpus_files(limit_bytes: int = 3_000_000, recursive: bool = False) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for f in sorted(root.rglob("*.py") if recursive else root.glob("*.py")):
        files.append(f)
        total += f.stat().st_size
        if total >= limit_bytes:
            break
    return files


def cache_root() -> Path:
    base = os.environ.get("SIEVE_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "sieve")
    return Path(base)


def demo_model_path() -> Path:
    """Folder of the demo checkpoint, building it on first use."""
    key = hashlib.sha256(f"{DEMO_VERSION}{sys.version_info[:2]}{json.dumps(MODEL_CONFIG, sort_keys=True)}".encode()).hexdigest()[:12]
    path = cache_root() / f"demo-llama-{key}"
    if not (path / "model.safetensors").exists():
        build_demo_model(path)
    log.warning("using sieve's built-in DEMO model (%s): random weights, output is not meaningful text", path)
    return path


def stdlib_bpe_tokenizer(vocab_size: int, corpus_bytes: int = 3_000_000, recursive: bool = False):
    """A byte-level BPE trained on the standard library's source: ids 0-2 are SPECIAL_TOKENS (EOS is
    <|im_end|>, so a chat turn ends generation), with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in _corpus_files(corpus_bytes, recursive)]
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the stdlib corpus gave {tok.get_vocab_size()} tokens, not {vocab_size}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_demo_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    stdlib_bpe_tokenizer(VOCAB_SIZE).save_pretrained(tmp)

    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in MODEL_CONFIG.items() if k not in ("architectures", "model_type")}))
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path) if not path.exists() else None
