"""The serving benchmark's arithmetic on recorded event streams, checked by hand."""

from __future__ import annotations

import math

import pytest

from sieve.bench.serving_stats import SLO, RequestRecord, percentile, summarize


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)  # 4 + 0.6 * (5 - 4)
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert math.isnan(percentile([], 50))


def test_ttft_tpot_itl_e2e_from_one_stream():
    # sent at 10.0; chunks at 10.5 (1 token), 10.6 (2 tokens), 10.9 (1 token): 4 tokens
    r = RequestRecord(sent=10.0, chunk_times=[10.5, 10.6, 10.9], chunk_tokens=[1, 2, 1])
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx((10.9 - 10.5) / 3)  # time after the first token over the 3 tokens after it
    assert r.itls == pytest.approx([0.1, 0.3])
    assert r.e2e == pytest.approx(0.9)
    one = RequestRecord(sent=0.0, chunk_times=[0.2], chunk_tokens=[1])
    assert one.tpot is None and one.itls == []


def test_summary_throughput_and_goodput():
    recs = [
        RequestRecord(0.0, [0.1, 0.2, 0.3], [1, 1, 1]),  # ttft .1, tpot .1
        RequestRecord(0.0, [0.5, 0.6, 0.7], [1, 1, 1]),  # ttft .5 (misses a .3 s TTFT objective)
        RequestRecord(0.0, [0.1, 0.5, 0.9], [1, 1, 1]),  # tpot .4 (misses a .2 s TPOT objective)
        RequestRecord(0.0, ok=False, error="HTTP 429"),
    ]
    s = summarize(recs, duration_s=2.0, slo=SLO(ttft_s=0.3, tpot_s=0.2))
    assert s["requests"] == 4 and s["completed"] == 3 and s["errors"] == 1
    assert s["request_throughput"] == pytest.approx(1.5) and s["output_token_throughput"] == pytest.approx(4.5)
    assert s["goodput"] == pytest.approx(0.5)  # only the first request met both objectives, over 2 s
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert s["ttft_s"]["p50"] == pytest.approx(0.1) and s["ttft_s"]["mean"] == pytest.approx(0.7 / 3)
    assert s["tpot_s"]["p99"] == pytest.approx(0.1 + (0.4 - 0.1) * 0.98)
    no_slo = summarize(recs, duration_s=2.0)
    assert no_slo["goodput"] == pytest.approx(1.5)  # without objectives every completed request counts
