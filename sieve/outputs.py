"""What the engine hands back: one `RequestOutput` per request, as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the chosen token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic) stamped by the engine; arithmetic happens at the edge."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding: drafts verified, tokens drafted, drafted tokens accepted (for this request).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        """Tokens per verified draft, bonus included (vLLM's mean acceptance length); None: no draft verified."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # Of those, the tokens whose KV was loaded from a KV tier below the pool (sieve/kv_tiers), per tier
    kv_tier_tokens: dict[str, int] = field(default_factory=dict)
    # KV compression: the prompt positions the press kept (per layer and KV head); None without compression
    kv_kept_tokens: int | None = None
    # With prompt_logprobs: one dict per prompt token (None for the first), the token's entry plus the top-N.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Embeddings (SamplingParams.pooling): the prompt's pooled hidden states, on the finished output
    embedding: list[float] | None = None
    # Per choice, the text and token ids produced since the previous output (for streaming).
    deltas: list[tuple[str, list[int]]] = field(default_factory=list)
    # Prefill/decode disaggregation: on a prefill server's finished output, where a decode server finds its KV
    kv_transfer_params: dict | None = None
    # --slo-reject: a request refused because its TTFT objective could no longer be met (finish_reason "slo_unmet")
    # carries when to try again, in seconds
    retry_after_s: float | None = None
