"""The one configuration object: everything the engine needs to know, validated once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str | None = None  # local folder or hub id; None means the built-in demo model
    tokenizer: str | None = None  # defaults to `model`
    skip_tokenizer_init: bool = False  # token ids in, token ids out (no text)
    revision: str | None = None
    dtype: str = "auto"  # auto (checkpoint's torch_dtype) | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0

    # KV cache
    block_size: int = 16
    kv_cache_memory_gb: float | None = None  # budget for the block pool; None: sized from free memory
    kv_cache_memory_fraction: float = 0.3  # share of free memory taken when no budget is given
    num_gpu_blocks_override: int | None = None  # exact number of blocks (tests)
    enable_prefix_caching: bool = True  # share the KV of full blocks whose whole prefix matches


    # Scheduler
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # "fcfs": (priority, arrival). "lpm": when at least `lpm_min_waiting` wait, admit the one with the
    # longest cached prefix first (SGLang's longest-prefix-match), but anyone waiting longer than
    # `lpm_max_wait_s` goes first, oldest first (the starvation guard).
    scheduling_policy: str = "fcfs"
    lpm_min_waiting: int = 8
    lpm_max_wait_s: float = 5.0

    # Threads (CPU)
    num_threads: int | None = None

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.scheduling_policy not in ("fcfs", "lpm"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'lpm', got {self.scheduling_policy!r}")
        if self.scheduling_policy == "lpm" and not self.enable_prefix_caching:
            raise ValueError("scheduling_policy 'lpm' orders requests by cached prefix: it needs prefix caching on")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if not self.enable_chunked_prefill and self.max_model_len and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "with chunked prefill off, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
