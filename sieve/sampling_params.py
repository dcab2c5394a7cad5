"""Per-request generation options, mirroring vLLM's `SamplingParams`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sieve.kv_compression import KVCompression
from sieve.pooling import PoolingParams
from sieve.structured.params import StructuredOutputsParams


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context limit; 0 (with prompt_logprobs): score the prompt only
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)
    logprobs: int | None = None  # top-N logprobs per generated token (plus the chosen one)
    prompt_logprobs: int | None = None  # per prompt token (the first has none): its logprob plus the top-N
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # output constrained to a schema, regex, choice or grammar
    # Prefill/decode disaggregation (vLLM's field): {"do_remote_decode": true} on a prefill server; on a decode
    # server, what the prefill server's response returned (where its blocks are). See sieve/distributed/kv_transfer.py.
    kv_transfer_params: dict | None = None
    # vLLM's `cache_salt`: prefix-cache blocks are shared only among requests with the same salt (tenant isolation)
    cache_salt: str | None = None
    # KV compression (sieve/kv_compression): a press and the fraction of the prompt's positions it removes; a
    # KVCompression, {"press": "snapkv", "ratio": 0.5} or "snapkv:0.5"
    kv_compression: KVCompression | dict | str | None = None
    # Embeddings (sieve/pooling.py): the prompt's pooled final hidden states instead of tokens (with max_tokens 0)
    pooling: PoolingParams | None = None
    # LoRA (sieve/lora): the adapter this request runs with, a LoRARequest (vLLM passes it beside the params:
    # LLM.generate(..., lora_request=...) and the server's `model` set it here)
    lora_request: object = None
    stop_strings: list[str] = field(init=False, default_factory=list)
    _bias: tuple | None = field(init=False, default=None, repr=False, compare=False)

    def bias_tensors(self, vocab: int):
        """logit_bias as (token ids, values) CPU tensors, built once per request (not per step)."""
        if self._bias is None or self._bias[0] != vocab:
            import torch

            items = [(t, v) for t, v in (self.logit_bias or {}).items() if t < vocab]
            self._bias = (vocab, torch.tensor([t for t, _ in items], dtype=torch.int64),
                          torch.tensor([v for _, v in items], dtype=torch.float32))
        return self._bias[1], self._bias[2]

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k in (0, None):
            self.top_k = -1
        if self.kv_compression is not None:
            self.kv_compression = KVCompression.of(self.kv_compression)
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            bad(f"seed must be an integer that fits in 64 bits, got {self.seed!r}")
        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad(f"top_k must be -1 (off) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1 and not (self.max_tokens == 0 and self.prompt_only):
            bad(f"max_tokens must be at least 1, got {self.max_tokens} (0 only scores the prompt: with prompt_logprobs, "
                "or echo with logprobs)")
        if self.pooling is not None:
            self._validate_pooling(bad)
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                bad(f"{name} must be a non-negative integer, got {value!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be token ids (non-negative integers), got {self.stop_token_ids}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs must be a StructuredOutputsParams")
            if self.min_tokens:
                bad("min_tokens cannot be combined with structured outputs: the grammar decides where the output ends")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            bad("cache_salt must be a non-empty string")
        if self.kv_compression is not None and self.n > 1:
            bad("kv_compression takes one choice per request (n = 1): each choice would compress its own copy")
        if any(not s for s in self.stop_strings):
            bad("stop strings must not be empty")
        for tok, value in (self.logit_bias or {}).items():
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                bad(f"logit_bias keys must be token ids (non-negative integers), got {tok!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:  # also refuses NaN
                bad(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {tok}")

    def _validate_pooling(self, bad) -> None:
        if not isinstance(self.pooling, PoolingParams):
            bad("pooling must be a PoolingParams")
        if self.max_tokens != 0 or self.n != 1:
            bad("pooling returns one embedding of the prompt, no tokens: it takes max_tokens 0 and n 1")
        for name in ("kv_compression", "kv_transfer_params", "structured_outputs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                bad(f"pooling cannot be combined with {name}")

    @property
    def prompt_only(self) -> bool:
        """The request asks only about its prompt (its logprobs, or its embedding): it ends once the prompt is computed."""
        return self.prompt_logprobs is not None or self.pooling is not None

    @property
    def whole_prompt(self) -> bool:
        """Every prompt position must be computed, none taken from the prefix cache (its blocks hold keys and values:
        no logits, no hidden states)."""
        return self.prompt_logprobs is not None or (self.pooling is not None and self.pooling.whole_prompt)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
