"""`sieve bench serve`: stream parsing on recorded event streams, workloads, the sweep against a live
sieve server, the llama.cpp comparison arithmetic, and the GGUF export it relies on."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from live_server import API_KEY, MODEL, wait_idle
from sieve.bench.serving import Load, Target, carries_output, parse_loads, run_load, send_turn, sweep, within_slo
from sieve.bench.serving_stats import SLO
from sieve.bench.workloads import Session, Turn, WorkloadSpec, from_jsonl


def sse(*objs) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs)


def mock_client(body: bytes, status: int = 200) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(lambda req: httpx.Response(status, content=body)))


def run_turn(body: bytes, chat: bool = False, status: int = 200):
    session = Session([Turn("hello", 4)], chat=chat)

    async def go():
        async with mock_client(body, status) as client:
            return await send_turn(client, Target("http://x/v1", "m"), session, session.turns[0],
                                   session.first_messages() if chat else None)

    return asyncio.run(go())


def test_recorded_completion_stream_uses_usage_for_token_counts():
    # sieve-style: one chunk per step; one step's token decodes to nothing (held back), usage at the end
    body = sse({"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
               {"choices": [{"index": 0, "text": "", "finish_reason": None}]},
               {"choices": [{"index": 0, "text": "bc", "finish_reason": "length"}]},
               {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}, b"[DONE]")
    rec, text = run_turn(body)
    assert rec.ok and text == "abc"
    assert len(rec.chunk_times) == 3 and rec.output_tokens == 3 and rec.prompt_tokens == 7
    assert rec.ttft > 0 and rec.tpot is not None


def test_recorded_chat_stream_skips_role_opener_and_bare_closing_chunk():
    # llama.cpp-style chat: a role chunk, a token per chunk, then an empty chunk carrying only finish_reason
    body = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
               {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]},
               {"choices": [{"index": 0, "delta": {"content": "y"}, "finish_reason": None}]},
               {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
               {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}, b"[DONE]")
    rec, text = run_turn(body, chat=True)
    assert rec.ok and text == "xy" and len(rec.chunk_times) == 2 and rec.output_tokens == 2


def test_without_usage_tokens_are_counted_from_chunks():
    body = sse(*({"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in "abcd"), b"[DONE]")
    rec, _ = run_turn(body)
    assert rec.reported_output_tokens is None and rec.output_tokens == 4


@pytest.mark.parametrize("body,status,fragment", [
    (b'{"error": {"message": "busy"}}', 429, "HTTP 429"),
    (sse({"error": {"message": "boom", "type": "server_error"}}), 200, "boom"),
    (sse(b"[DONE]"), 200, "no output"),
])
def test_failures_are_recorded_not_raised(body, status, fragment):
    rec, _ = run_turn(body, status=status)
    assert not rec.ok and fragment in rec.error


def test_carries_output_rules():
    assert carries_output({"text": "a", "finish_reason": "stop"})
    assert carries_output({"delta": {}, "finish_reason": None})  # a token with no text yet
    assert not carries_output({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
    assert not carries_output({"text": "", "finish_reason": "length"})


def test_parse_loads_and_slo_judgement():
    assert [l.concurrency for l in parse_loads("1,4,32", None)] == [1, 4, 32]
    assert math.isinf(parse_loads(None, "0.5,inf")[1].request_rate)
    for bad in (("1", "2"), (None, None), ("0", None), (None, "-1")):
        with pytest.raises(ValueError):
            parse_loads(*bad)
    ok = {"errors": 0, "completed": 3, "ttft_s": {"p99": 1.0}, "tpot_s": {"p99": 0.1}}
    assert within_slo(ok, SLO(2.0, 0.2))
    assert not within_slo({**ok, "ttft_s": {"p99": 2.5}}, SLO(2.0, 0.2))
    assert not within_slo({**ok, "tpot_s": {"p99": 0.25}}, SLO(2.0, 0.2))
    assert not within_slo({**ok, "errors": 1}, SLO(2.0, 0.2))


def test_workloads_are_seeded_and_sized(demo_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir)
    spec = WorkloadSpec(dataset="synthetic", num_prompts=6, input_len=(20, 40), output_len=(5, 9), seed=3)
    a, b = spec.build(tok), spec.build(tok)
    assert [s.turns[0].user for s in a] == [s.turns[0].user for s in b]
    for s in a:
        assert 10 <= len(tok.encode(s.turns[0].user, add_special_tokens=False)) <= 40
        assert 5 <= s.turns[0].max_tokens <= 9

    sp = WorkloadSpec(dataset="shared-prefix", num_prompts=12, num_prefixes=3, prefix_len=50, seed=1).build(tok)
    assert len({s.system for s in sp}) == 3 and all(s.completion_prompt(s.turns[0]).startswith(s.system) for s in sp)

    mt = WorkloadSpec(dataset="multi-turn", num_prompts=2, turns=3).build(tok)
    assert all(s.chat and len(s.turns) == 3 and s.system is None for s in mt)
    mt = WorkloadSpec(dataset="multi-turn", num_prompts=3, turns=2, system_len=40).build(tok)
    assert len({s.system for s in mt}) == 1 and 20 <= len(tok.encode(mt[0].system, add_special_tokens=False)) <= 40
    assert all(m["role"] == "system" for m in [s.first_messages()[0] for s in mt])

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi", "max_tokens": 3}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    rows = from_jsonl(f, None, 16)
    assert rows[0].turns[0].max_tokens == 3 and rows[1].chat and rows[1].turns[0].max_tokens == 16
    f.write_text('{"nothing": 1}\n')
    with pytest.raises(ValueError, match="prompt"):
        from_jsonl(f, None, 16)
    with pytest.raises(ValueError, match="unknown dataset"):
        WorkloadSpec(dataset="nope").build(tok)


@pytest.fixture(scope="module")
def live(llama_server):
    return llama_server[0] + "/v1", llama_server[1]


def test_sweep_against_a_live_sieve_server(live, llama_dir):
    """One short live run: every request completes with exactly its max_tokens (ignore_eos), counted from
    usage; the sweep reports every load point and the largest one within the SLO; no KV block leaks."""
    from transformers import AutoTokenizer

    url, engine = live
    tok = AutoTokenizer.from_pretrained(llama_dir)
    points = WorkloadSpec(num_prompts=8, input_len=(8, 40), output_len=(4, 12), seed=0).build_points(tok, 2)
    assert points[0][0].turns[0].user != points[1][0].turns[0].user  # each load point has its own prompts
    result = sweep(Target(url, MODEL, API_KEY), points, parse_loads("1,4", None), SLO(30.0, 5.0), progress=False,
                   log=lambda s: None)
    assert [r["concurrency"] for r in result["runs"]] == [1, 4]
    for r, sessions in zip(result["runs"], points):
        want = sum(s.turns[0].max_tokens for s in sessions)
        assert r["completed"] == 8 and r["errors"] == 0 and r["within_slo"]
        assert r["output_token_throughput"] * r["duration_s"] == pytest.approx(want)
        assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] and r["tpot_s"]["p50"] > 0
    assert result["max_concurrency_within_slo"] == 4
    wait_idle(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_burst_against_sieve_scores_its_expected_wait(live, llama_dir):
    """--queue-eta: each request asks for sieve's expected wait; the run reports the wait the server measured and the
    estimate's absolute error (a burst of 24 on a tiny model: queued for real; the error is only reported here)."""
    from transformers import AutoTokenizer

    from sieve.bench.serving_stats import summarize

    url, engine = live
    tok = AutoTokenizer.from_pretrained(llama_dir)
    warm = WorkloadSpec(num_prompts=4, input_len=(8, 40), output_len=(4, 4), seed=4).build(tok)
    asyncio.run(run_load(Target(url, MODEL, API_KEY), warm, Load(concurrency=1), progress=False))
    assert engine.step_timer.ready  # steps of several sizes measured
    sessions = WorkloadSpec(num_prompts=24, input_len=(8, 40), output_len=(16, 16), seed=3).build(tok)
    records, duration = asyncio.run(run_load(Target(url, MODEL, API_KEY, queue_eta=True), sessions,
                                             Load(request_rate=math.inf), progress=False))
    assert all(r.ok for r in records)
    assert all(r.queue_ms is not None and r.queue_ms >= 0 for r in records)
    s = summarize(records, duration)
    assert s["queue_s"]["p90"] >= 0 and s["queue_eta_error_s"]["p50"] >= 0
    assert sum(r.queue_eta_ms is not None for r in records) == len(records)


def test_multi_turn_resends_the_growing_history(live, llama_dir):
    from transformers import AutoTokenizer

    url, engine = live
    tok = AutoTokenizer.from_pretrained(llama_dir)
    sessions = WorkloadSpec(dataset="multi-turn", num_prompts=2, turns=3, input_len=(5, 10), output_len=(4, 6)).build(tok)
    records, _ = asyncio.run(run_load(Target(url, MODEL, API_KEY), sessions, Load(request_rate=math.inf), progress=False))
    assert len(records) == 6 and all(r.ok for r in records)
    for conv in range(2):
        turns = sorted((r for r in records if r.session == conv), key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2]
        for before, after in zip(turns, turns[1:]):  # a turn's prompt holds the previous prompt and answer
            assert after.prompt_tokens >= before.prompt_tokens + before.output_tokens
            assert after.sent >= before.sent + before.e2e  # and is sent only after that answer arrived


def test_a_wrong_model_name_is_an_error_per_request(live):
    url, _ = live
    sessions = [Session([Turn("hello there", 4)]) for _ in range(2)]
    records, _ = asyncio.run(run_load(Target(url, "no-such-model", API_KEY), sessions, Load(concurrency=2), progress=False))
    assert all(not r.ok and "404" in r.error for r in records)


def test_ratio_table_divides_sieve_by_the_peer():
    from sieve.bench.llama_cpp import format_table, ratio_table

    def run(c, thr, ttft, tpot, good):
        return {"concurrency": c, "output_token_throughput": thr, "goodput": good,
                "ttft_s": {"p50": ttft, "p99": 2 * ttft}, "tpot_s": {"p50": tpot, "p99": 2 * tpot}}

    ours = {"runs": [run(1, 20, 0.1, 0.05, 1.0), run(32, 300, 0.5, 0.1, 4.0)], "max_concurrency_within_slo": 32}
    theirs = {"runs": [run(1, 25, 0.2, 0.04, 1.0), run(32, 100, 1.0, 0.3, 0.0)], "max_concurrency_within_slo": 8}
    rows = ratio_table(ours, theirs, "concurrency")
    assert rows[0]["output_throughput"] == pytest.approx(0.8) and rows[0]["tpot_p50"] == pytest.approx(1.25)
    assert rows[1]["output_throughput"] == pytest.approx(3.0) and rows[1]["ttft_p99"] == pytest.approx(0.5)
    assert math.isnan(rows[1]["goodput"])  # the peer met the SLO for nothing: no finite ratio
    table = format_table(rows, "concurrency", ours, theirs, "llama.cpp")
    assert "sieve 32, llama.cpp 8" in table and "| 4.00× |" not in table and "— (other 0)" in table and "nan" not in table
    theirs["max_concurrency_within_slo"] = None
    assert "llama.cpp none of the loads" in format_table(rows, "concurrency", ours, theirs, "llama.cpp")


def test_cli_bench_serve_writes_json_and_plot(live, llama_dir, tmp_path, capsys):
    from sieve.cli import main

    url, _ = live
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["bench", "serve", "--base-url", url, "--model", MODEL, "--api-key", API_KEY, "--tokenizer", str(llama_dir),
               "--num-prompts", "4", "--input-len", "8:16", "--output-len", "3:5", "--request-rate", "50,inf",
               "--slo-ttft-ms", "30000", "--slo-tpot-ms", "5000", "--output-json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["request_rate"] for r in result["runs"]] == [50, math.inf]
    assert result["max_request_rate_within_slo"] == math.inf
    assert png.stat().st_size > 10_000
    assert "rate=50/s" in capsys.readouterr().out
    assert main(["bench", "serve", "--base-url", url, "--model", MODEL, "--concurrency", "1"]) == 2  # no key for /tokenize
    assert main(["bench", "serve", "--base-url", url, "--model", MODEL, "--api-key", API_KEY, "--tokenizer", str(llama_dir),
                 "--concurrency", "1", "--batch-requests", "2"]) == 2  # a server without --batch-dir has no /v1/files
    # no --tokenizer: the server's /tokenize and /detokenize size the prompts; --endpoint picks the chat API
    rc = main(["bench", "serve", "--base-url", url, "--api-key", API_KEY, "--endpoint", "/v1/chat/completions",
               "--num-prompts", "3", "--input-len", "20:20", "--output-len", "2:2", "--concurrency", "1", "--no-progress",
               "--output-json", str(out)])
    run = json.loads(out.read_text())["runs"][0]
    tok = _tokenizer(llama_dir)
    template = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False))
    assert rc == 0 and run["completed"] == 3
    assert abs(run["prompt_tokens"] - 3 * (20 + template)) <= 3 * 2  # 20 tokens of user text each, give or take re-encoding
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--base-url", url, "--endpoint", "/v1/embeddings"])
    assert main(["bench", "serve", "--base-url", url, "--api-key", API_KEY, "--tokenizer", str(llama_dir), "--dataset", "multi-turn",
                 "--endpoint", "/v1/completions", "--concurrency", "1"]) == 2  # conversations need the chat endpoint
    # vLLM's convention: the server's URL without /v1 (and a trailing slash) means the same API root
    rc = main(["bench", "serve", "--base-url", url.removesuffix("/v1") + "/", "--api-key", API_KEY, "--tokenizer", str(llama_dir),
               "--num-prompts", "2", "--input-len", "8:8", "--output-len", "2:2", "--concurrency", "1", "--no-progress",
               "--output-json", str(out)])
    assert rc == 0 and json.loads(out.read_text())["base_url"] == url and json.loads(out.read_text())["model"] == MODEL


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_the_expected_wait_scored_is_the_one_told_when_it_queued():
    """sieve tells a waiting stream its expected wait again as it falls: the estimate scored is the first, made as the
    request queued, not the last (near 0 just before it starts)."""
    import httpx

    from sieve.bench.serving import send_turn
    from sieve.bench.workloads import Session, Turn

    stream = (b": queue queue-position=3 queue-eta-ms=1800\n\n: queue queue-position=0 queue-eta-ms=20\n\n"
              b'data: {"choices": [{"index": 0, "text": "hi"}]}\n\n'
              b'data: {"choices": [], "metrics": {"queue_ms": 1750.0}}\n\ndata: [DONE]\n\n')
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=stream,
                                                                   headers={"content-type": "text/event-stream"}))

    async def one():
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_turn(client, Target("http://sieve.test/v1", MODEL, queue_eta=True),
                                   Session([Turn("hello", 4)]), Turn("hello", 4), None)

    rec, text = asyncio.run(one())
    assert rec.ok and text == "hi" and rec.queue_eta_ms == 1800.0 and rec.queue_ms == 1750.0
