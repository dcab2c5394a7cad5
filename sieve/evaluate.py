"""`sieve eval`: what a lossy option costs, on the user's own text.

The text is tokenized once and cut into windows of `window` tokens; every window is scored by the
reference engine (the checkpoint as it is, no quantization, model-dtype KV cache) and by the engine
with the options under test. Reported over all predicted positions:
    perplexity       exp(mean negative log-likelihood of the next token), for both engines
    KL divergence    mean over positions of KL(reference || candidate) of the next-token distributions
    top-1 agreement  share of positions where both engines' most likely next token is the same
Windows are prefilled in chunks of `chunk` tokens so that later chunks read earlier K/V back from
the cache, as serving does; a quantized KV cache therefore shows its cost here.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from sieve.config import EngineConfig
from sieve.engine import LLMEngine


def load_engine(model: str, dtype: str, window: int, **options) -> LLMEngine:
    blocks = -(-window // 16) + 1
    return LLMEngine(EngineConfig(model=model, dtype=dtype, enable_prefix_caching=False, num_gpu_blocks_override=blocks,
                                  max_model_len=max(window, 16), **options))


def evaluate(model: str, data: str | Path, dtype: str = "auto", window: int = 256, max_windows: int | None = None,
             chunk: int = 64, reference: str | None = None, reference_dtype: str | None = None,
             reference_dequantize: bool = False, **options) -> dict:
    """`options`: engine options under test (quantization, kv_cache_dtype, quantization_group_size,
    dequantize, ...). `reference`: the unquantized checkpoint when `model` is itself quantized (an AWQ
    checkpoint); `reference_dtype` (default `dtype`) and `reference_dequantize` (widen a GGUF file's
    quantized weights) say how the reference runs."""
    ref = load_engine(reference or model, reference_dtype or dtype, window, dequantize=reference_dequantize)
    cand = load_engine(model, dtype, window, **options)
    ids = ref.tokenizer(Path(data).read_text(), add_special_tokens=True).input_ids
    windows = [ids[i : i + window] for i in range(0, len(ids) - 1, window) if len(ids[i : i + window]) > 1]
    if max_windows:
        windows = windows[:max_windows]
    if not windows:
        raise ValueError(f"{data}: not enough text for one window")
    nll_ref = nll_cand = kl = agree = 0.0
    n = 0
    for w in windows:
        lr = torch.log_softmax(ref.score(w, chunk)[:-1], dim=-1)  # [T-1, V] predictions of tokens 1..T-1
        lc = torch.log_softmax(cand.score(w, chunk)[:-1], dim=-1)
        target = torch.tensor(w[1:])
        nll_ref -= lr.gather(1, target[:, None]).sum().item()
        nll_cand -= lc.gather(1, target[:, None]).sum().item()
        kl += (lr.exp() * (lr - lc)).sum().item()
        agree += (lr.argmax(-1) == lc.argmax(-1)).sum().item()
        n += len(w) - 1
    return {"model": model, "reference": reference or model, "reference_dtype": str(ref.dtype).removeprefix("torch."),
            "reference_dequantize": reference_dequantize, "dtype": str(cand.dtype).removeprefix("torch."),
            "data": str(data), "options": options, "windows": len(windows), "window": window,
            "tokens_scored": n, "reference_perplexity": math.exp(nll_ref / n), "perplexity": math.exp(nll_cand / n),
            "kl_divergence": kl / n, "top1_agreement": agree / n,
            "weight_bytes": sum(m.weight_bytes for m in _linears(cand)),
            "reference_weight_bytes": sum(m.weight_bytes for m in _linears(ref))}


def _linears(engine: LLMEngine):
    from sieve.layers.linear import Linear

    return [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
