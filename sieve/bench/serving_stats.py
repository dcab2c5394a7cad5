"""The arithmetic of a serving benchmark, from what a client records per request.

A request is recorded as its send time, the arrival time of every streamed chunk that carried tokens,
how many tokens each chunk carried (from the server's usage where it reports it), and whether it
succeeded. Everything else is derived here:

    TTFT  = first token chunk - sent
    TPOT  = (last token chunk - first token chunk) / (output tokens - 1)     (time per output token after the first)
    ITL   = gaps between consecutive token chunks                          (inter-token latency, one per gap)
    E2E   = last chunk - sent
    goodput = requests per second that succeeded and met both the TTFT and the TPOT objective
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    sent: float  # seconds, any monotonic clock shared by the whole run
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each such chunk
    prompt_tokens: int = 0
    reported_output_tokens: int | None = None  # the server's usage.completion_tokens, when it sent one
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    ok: bool = True
    error: str | None = None
    session: int = 0  # which simulated user sent it, and which of its turns it was
    turn: int = 0
    queue_eta_ms: float | None = None  # sieve's estimate of its wait when it queued (stream_options.include_queue)
    queue_ms: float | None = None  # and the wait it then had, as the server measured it

    @property
    def output_tokens(self) -> int:
        """The server's own count where it reports one (fair across engines), else tokens seen in chunks."""
        return self.reported_output_tokens if self.reported_output_tokens is not None else sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.ok and self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])] if self.ok else []

    @property
    def e2e(self) -> float | None:
        return self.chunk_times[-1] - self.sent if self.ok and self.chunk_times else None


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]. NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else math.nan
    return {"mean": mean, "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99)}


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft is None:
            return False
        if self.ttft_s is not None and r.ttft > self.ttft_s:
            return False
        tpot = r.tpot
        return not (self.tpot_s is not None and tpot is not None and tpot > self.tpot_s)


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO = SLO()) -> dict:
    """Throughput, latency distributions (seconds) and goodput for one run lasting `duration_s`."""
    done = [r for r in records if r.ok]
    good = [r for r in done if slo.met(r)]
    return {
        "requests": len(records),
        "completed": len(done),
        "errors": len(records) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "output_token_throughput": sum(r.output_tokens for r in done) / duration_s,
        "ttft_s": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": distribution([r.tpot for r in done if r.tpot is not None]),
        "itl_s": distribution([g for r in done for g in r.itls]),
        "e2e_s": distribution([r.e2e for r in done if r.e2e is not None]),
        "goodput": len(good) / duration_s,
        "slo_attainment": len(good) / len(records) if records else math.nan,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        # share of prompt tokens the server says it took from its prefix cache (None: it does not say)
        "prefix_cache_hit_rate": (sum(r.cached_tokens or 0 for r in done) / max(1, sum(r.prompt_tokens for r in done))
                                  if any(r.cached_tokens is not None for r in done) else None),
        # sieve's expected wait against the wait (seconds, absolute error), where the server told both
        "queue_eta_error_s": distribution([abs(r.queue_eta_ms - r.queue_ms) / 1e3 for r in done
                                           if r.queue_eta_ms is not None and r.queue_ms is not None]),
        "queue_s": distribution([r.queue_ms / 1e3 for r in done if r.queue_ms is not None]),
    }
