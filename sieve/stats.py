"""A snapshot of the engine's counters, handed out by `LLMEngine.stats()` (as vLLM's SchedulerStats): what /metrics
and benchmarks read, so that none of them reaches into the scheduler, the block manager or the speculator."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVTransferStats:
    """Per direction (save, load) and per reason (fallbacks, refused)."""

    bytes: dict = field(default_factory=dict)
    blocks: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    fallbacks: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)


@dataclass(frozen=True)
class KVTierStats:
    """The KV tiers below the pool: blocks loaded (hits), held and evicted per tier; bytes and seconds per tier and
    direction (write, read); blocks failing their check; writes failed per tier or dropped (queue full); blocks left
    to recompute, by reason; of the hits, those loaded for preempted sequences resuming."""

    hits: dict = field(default_factory=dict)
    blocks_held: dict = field(default_factory=dict)
    evictions: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    checksum_failures: int = 0
    write_errors: dict = field(default_factory=dict)
    read_errors: dict = field(default_factory=dict)
    dropped_writes: int = 0
    recomputed: dict = field(default_factory=dict)
    resumed: dict = field(default_factory=dict)  # of the hits, blocks loaded for preempted sequences resuming
    dtype: str = "auto"  # how blocks are held: auto (the pool's bytes, lossless) or int8 (lossy, sieve/kv_tiers/lossy.py)


@dataclass(frozen=True)
class KVCompressionStats:
    """KV compression: requests pressed, their prompt tokens and the positions dropped (per layer and head: the slots
    each layer no longer holds), presses skipped (no room for the compacted copy), seconds spent pressing."""

    requests: int = 0
    prompt_tokens: int = 0
    dropped_tokens: int = 0
    skipped: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class StructuredStats:
    mask_seconds: float = 0.0
    num_masked_steps: int = 0
    num_masked_rows: int = 0
    grammars_compiled: int = 0
    grammar_cache_hits: int = 0
    compile_seconds: float = 0.0


@dataclass(frozen=True)
class LoRAStats:
    """LoRA adapters (vLLM's lora_requests_info): those of running and of waiting requests, at most `max_loras` in a
    step; registered, held in memory, and reads from disk since start."""

    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    max_loras: int = 0
    registered: int = 0
    in_memory: int = 0
    loads: int = 0


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0 to 1
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    prefix_cache_blocks: int
    structured: StructuredStats
    spec_decode: SpecDecodeStats | None = None  # None: speculation off
    kv_transfer: KVTransferStats | None = None  # None: no KV transfer
    kv_tiers: KVTierStats | None = None  # None: no KV tiers
    kv_compression: KVCompressionStats = field(default_factory=KVCompressionStats)
    lora: LoRAStats | None = None  # None: LoRA off
