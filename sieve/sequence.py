"""One request's state as it moves through the engine.

A request asking for `n` choices becomes `n` sequences that share a `Request`. The scheduler
and the model runner see only sequences; the output processor regroups them per request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from sieve.outputs import Logprob, RequestMetrics
from sieve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int  # lower is served first (as in vLLM)
    metrics: RequestMetrics
    seqs: list["Sequence"] = field(default_factory=list)
    unforked: list["Sequence"] = field(default_factory=list)  # choices 1..n-1 until choice 0's prompt is computed
    # With params.prompt_logprobs: one entry per prompt token computed so far (the first token's is None).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    kv_export: bool = False  # a prefill server's request ({"do_remote_decode": true}): its KV is saved when it finishes
    num_transferred_tokens: int = 0  # a decode server's request: prompt tokens whose KV came from the prefill server
    kv_tier_tokens: dict[str, int] = field(default_factory=dict)  # prompt tokens whose KV a KV tier held, per tier
    kv_kept_tokens: int | None = None  # KV compression: prompt positions the press kept (per layer and KV head)
    tenant: str | None = None  # who asked (--tenants), for fair shares within its tier
    tier: str | None = None  # its tier: guaranteed running slots (sieve/tenancy.py)
    lora: Any = None  # the LoRAAdapter its rows run with (sieve/lora), or None: the base model
    pooler: Any = None  # embeddings: its prompt's pooled hidden states, as prefill chunks compute them (sieve/pooling.py)

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)


@dataclass
class Draft:
    """Speculative decoding: tokens drafted to follow a sequence's tokens (what a proposer returns, and what the
    sequence holds until the next step verifies it; never part of its token_ids until accepted), the distribution
    each was drawn from ([len(token_ids), vocab] float32; None: deterministic, q one-hot), and a draft tree's further
    chains (deterministic; num_branches)."""

    token_ids: list[int] = field(default_factory=list)
    probs: Any = None
    alternatives: list[list[int]] = field(default_factory=list)

    def clear(self) -> None:
        self.token_ids, self.probs, self.alternatives = [], None, []


@dataclass
class WindowState:
    """A sequence's table in the sliding-window layers' own pool (models with such layers): blocks that left the
    window are PAD (-1); `registered`: its leading blocks already in that pool's prefix cache."""

    table: list[int] = field(default_factory=list)
    registered: int = 0


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int  # choice index within the request
    arrival_order: int  # tie-breaker for FCFS among equal priorities
    token_ids: list[int]  # prompt followed by generated tokens
    seed: int | None  # the request's seed (each choice draws from (seed, index, position))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache when first scheduled
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks (block manager's memo)
    num_registered_blocks: int = 0  # leading blocks of block_table already entered in the prefix cache
    window: WindowState = field(default_factory=lambda: WindowState())  # the sliding-window layers' own pool
    state_slot: int = -1  # recurrent (Mamba-2) layers: the slot of this sequence's state while it runs
    draft_state: Draft = field(default_factory=lambda: Draft())  # speculative decoding's next draft
    grammar: Any = None  # structured outputs: this sequence's GrammarMatcher (sieve/structured), or None
    # KV compression (sieve/kv_compression): whether the press ran on the prompt, and the positions it dropped. Token
    # p's K/V is in slot p - kv_dropped of block_table; its rotary position stays p.
    kv_compressed: bool = False
    kv_dropped: int = 0
    kv_cells: Any = None  # with per-layer budgets, where each layer's kept positions are (LayerCells), else None
    query_stats: Any = None  # a press's statistics of the prompt's queries, gathered during its prefill (QueryStats)

    # Output side (written by the output processor).
    output_text: str = ""
    num_text_emitted: int = 0  # chars of output_text already streamed
    num_tokens_emitted: int = 0  # output tokens already streamed
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def schedule_key(self) -> tuple[int, int]:
        """Order of service: priority, then arrival. The largest key is preempted first."""
        return (self.request.priority, self.arrival_order)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not all computed: this sequence's prefill must compute every
        prompt position (logits come from hidden states, which the prefix cache does not keep)."""
        lps = self.request.prompt_logprobs
        return lps is not None and len(lps) < self.num_prompt_tokens

    @property
    def press_pending(self) -> bool:
        """KV compression is asked for and the press has not run on this sequence's prompt yet."""
        return self.params.kv_compression is not None and not self.kv_compressed

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
