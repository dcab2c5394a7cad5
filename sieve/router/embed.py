"""Prompt embeddings computed in the gateway's own process: no network call per request (RouteLLM's
recommended router calls a hosted embeddings API on every one, and its users hit rate limits).

- `hash`: signed feature hashing of words and word pairs. Microseconds, no model; what the tests use.
- `model:<path>`: the mean of a sieve model's last hidden states over the prompt (e.g. the weak model's own
  GGUF file), run on the gateway's CPU. What the learned router uses on real pairs.

`make_embedder(spec)` builds either from its spec string, which the classifier file records so that serving
embeds exactly as training did."""

from __future__ import annotations

import hashlib
import re
import threading

import torch

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class HashEmbedder:
    def __init__(self, dim: int = 4096):
        self.dim = dim
        self.spec = f"hash:{dim}"

    def _slot(self, feature: str) -> tuple[int, float]:
        h = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")
        return h % self.dim, 1.0 if (h >> 63) & 1 else -1.0

    def __call__(self, texts: list[str]) -> torch.Tensor:
        out = torch.zeros(len(texts), self.dim)
        for i, text in enumerate(texts):
            w = words(text)
            for feature in w + [a + " " + b for a, b in zip(w, w[1:])]:
                j, sign = self._slot(feature)
                out[i, j] += sign
        return torch.nn.functional.normalize(out, dim=-1)


class ModelEmbedder:
    """Mean-pooled last hidden states of a sieve model (loaded on first use, float32 on the CPU)."""

    def __init__(self, path: str, max_tokens: int = 512):
        self.path, self.max_tokens = path, max_tokens
        self.spec = f"model:{path}"
        self._engine = None
        self._lock = threading.Lock()  # one engine, used from the gateway's worker threads one at a time

    def _load(self):
        if self._engine is None:
            from sieve.config import EngineConfig
            from sieve.engine import LLMEngine

            self._engine = LLMEngine(EngineConfig(model=self.path, dtype="float32", device="cpu", max_num_seqs=1,
                                                  enable_prefix_caching=False, kv_cache_memory_gb=0.25))
        return self._engine

    def __call__(self, texts: list[str]) -> torch.Tensor:
        with self._lock:
            engine = self._load()
            rows = []
            for text in texts:
                ids = engine.tokenizer.encode(text, add_special_tokens=False)[-self.max_tokens:] or [0]
                rows.append(engine.hidden_states(ids).float().mean(0))
        return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


_MODELS: dict[str, ModelEmbedder] = {}  # one loaded model per path, however many classifiers use it


def make_embedder(spec: str):
    kind, _, arg = spec.partition(":")
    if kind == "hash":
        return HashEmbedder(int(arg) if arg else 4096)
    if kind == "model" and arg:
        if arg not in _MODELS:
            _MODELS[arg] = ModelEmbedder(arg)
        return _MODELS[arg]
    raise ValueError(f"unknown embedder {spec!r}: use hash[:DIM] or model:PATH")
