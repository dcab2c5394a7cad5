"""`sieve bench ladder`: the capacity search (on a probe and on a fake server of known capacity), the closed
loop, and the ladder's JSON (its schema, and an end-to-end run on the demo model)."""


import argparse
import asyncio
import json
import threading

import pytest

from sieve.bench.ladder import (LADDER_SCHEMA, RUNGS, Probe, add_bench_ladder_args, chat_sessions, closed_loop,
                                find_capacity, point_summary, run_ladder, validate_ladder)


def known_capacity(capacity: int):
    calls = []

    def probe(users: int) -> Probe:
        calls.append(users)
        return Probe(users, users <= capacity)

    return probe, calls


@pytest.mark.parametrize("capacity", [0, 1, 2, 3, 7, 16, 33, 100, 255])
@pytest.mark.parametrize("start", [1, 5, 40])
def test_find_capacity_finds_a_known_capacity(capacity, start):
    probe, calls = known_capacity(capacity)
    users, probes = find_capacity(probe, start=start, growth=1.5, max_users=256, resolution=0.0)
    assert users == capacity
    assert [p.users for p in probes] == calls and len(set(calls)) == len(calls)  # never probes a count twice
    assert len(calls) <= 20


def test_find_capacity_resolution_and_cap():
    probe, calls = known_capacity(100)
    users, _ = find_capacity(probe, start=1, growth=2.0, max_users=256, resolution=0.1)
    assert 91 <= users <= 100 and users in calls  # within 10% of the lower end, never above the capacity
    probe, calls = known_capacity(10_000)
    users, _ = find_capacity(probe, start=1, growth=2.0, max_users=48)
    assert users == 48 and max(calls) == 48
    with pytest.raises(ValueError):
        find_capacity(probe, growth=1.0)


class FakeServer:
    """A streaming chat server of known capacity: each token comes 20 ms after the last, or 300 ms when more than
    `capacity` requests are in flight at that token. A request stops counting before its last chunk is sent, so
    `capacity` closed-loop users never exceed it; one more always does (each request lasts 120 ms and a user's
    next follows within a millisecond). With TPOT p99 <= 100 ms, the capacity is exact on any machine."""

    def __init__(self, capacity: int, tokens: int = 6):
        from fastapi import FastAPI, Request
        from fastapi.responses import StreamingResponse

        self.capacity, self.in_flight, self.lock = capacity, 0, threading.Lock()
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            with self.lock:
                self.in_flight += 1

            async def events():
                counted = True

                def leave():
                    nonlocal counted
                    if counted:
                        with self.lock:
                            self.in_flight -= 1
                        counted = False

                try:
                    for i in range(tokens):
                        await asyncio.sleep(0.3 if self.in_flight > self.capacity else 0.02)
                        yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}]}) + "\n\n"
                    leave()
                    usage = {"prompt_tokens": len(json.dumps(body["messages"])), "completion_tokens": tokens}
                    yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "usage": usage}) + "\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    leave()

            return StreamingResponse(events(), media_type="text/event-stream")

        self.app = app


@pytest.fixture
def fake_server():
    from sieve.server.serve import serve_in_thread

    servers = []

    def make(capacity: int):
        fake = FakeServer(capacity)
        url, stop = serve_in_thread(fake.app)
        servers.append(stop)
        return url + "/v1"

    yield make
    for stop in servers:
        stop()


@pytest.mark.parametrize("capacity", [3, 5])
def test_bisection_over_a_fake_server_finds_its_capacity(fake_server, capacity):
    from sieve.bench.serving import Target
    from sieve.bench.serving_stats import SLO

    target = Target(fake_server(capacity), "fake", ignore_eos=False, timeout_s=60)
    slo = SLO(2.0, 0.1)
    sessions = chat_sessions(40, 0, 6)

    def probe(users: int) -> Probe:
        records, duration = asyncio.run(closed_loop(target, sessions, users, warmup_s=0.3, measure_s=1.2, ramp_s=0.0, seed=users))
        s = point_summary(records, duration, slo)
        if users <= capacity:
            assert s["completed"] > users  # every user got answers in the measured window
        return Probe(users, s["within_slo"], s)

    users, probes = find_capacity(probe, start=1, growth=2.0, max_users=16, resolution=0.0)
    assert users == capacity, [(p.users, p.within_slo, p.summary["tpot_s"]["p99"]) for p in probes]


def _ladder(**over) -> dict:
    rungs = []
    for i, r in enumerate(RUNGS):
        probes = [{"users": u, "within_slo": u <= 4 * (i + 1), "ttft_p99_ms": 10.0, "tpot_p99_ms": 20.0,
                   "output_tokens_per_s": 100.0} for u in (4 * (i + 1), 4 * (i + 1) + 1)]
        rungs.append({"key": r.key, "name": r.name, "weights": r.weights, "kv": r.kv, "users": 4 * (i + 1), "factor": i + 1.0,
                      "gain": None if i == 0 else (i + 1) / i, "planner": {"users": 5 * (i + 1), "factor": i + 1.0, "gain": None, "binding": "compute"},
                      "quality": {"kl_divergence": 0.01, "top1_agreement": 0.97, "perplexity": 9.0} if r.lossy else None,
                      "probes": probes})
    out = {"schema": "sieve.bench.ladder/1", "model": "m.gguf", "machine": {}, "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 100},
           "workload": {}, "memory_gb": 0.5, "naive": "hf", "rungs": rungs}
    out.update(over)
    return out


def test_ladder_schema_accepts_a_ladder_and_names_what_is_wrong():
    validate_ladder(_ladder())
    for bad, where in [(_ladder(schema="other"), "schema"), (_ladder(naive="vllm"), "naive"), (_ladder(rungs=[]), "rungs"),
                       (_ladder(slo={"ttft_p99_ms": 2000}), "slo")]:
        with pytest.raises(ValueError, match=where):
            validate_ladder(bad)
    broken = _ladder()
    broken["rungs"][2]["quality"] = {"kl_divergence": -1, "top1_agreement": 0.9, "perplexity": 1}
    with pytest.raises(ValueError, match="rungs/2/quality"):
        validate_ladder(broken)
    inconsistent = _ladder()
    inconsistent["rungs"][1]["users"] = 9  # more than its probes showed
    with pytest.raises(ValueError, match="capacity 9 was never probed"):
        validate_ladder(inconsistent)
    assert LADDER_SCHEMA["properties"]["rungs"]["items"]["properties"]["key"]["enum"] == [r.key for r in RUNGS]


@pytest.mark.parametrize("flags, message", [
    (["--growth", "1"], "--growth must be > 1"), (["--measure", "0"], "--measure must be > 0"),
    (["--slo-tpot-ms", "-5"], "--slo-tpot-ms must be > 0"), (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--memory-gb", "0"], "--memory-gb must be > 0"), (["--rungs", "naive,turbo"], "unknown turbo"),
    (["--kv-checkpoint", "/no/such/dir"], "no such file"),
    (["--kv-checkpoint", ".", "--rungs", "naive,batching"], "leaves out"),
    (["--workload", "chat,long", "--memory-gb", "1,2,3"], "one value or one per workload"),
    (["--at-users", "0"], "--at-users must be >= 1"), (["--at-users", "4", "--plot", "x.png"], "--plot belongs to a ladder"),
])
def test_ladder_refuses_bad_flags_before_starting_anything(demo_dir, flags, message):
    from sieve.config import ConfigError

    p = argparse.ArgumentParser()
    add_bench_ladder_args(p)
    with pytest.raises(ConfigError, match=message):
        run_ladder(p.parse_args(["--model", str(demo_dir), *flags]))


def demo_ladder_args(tmp_path, name: str, *flags: str) -> argparse.Namespace:
    """A ladder on the random demo model fast enough for a test, with an SLO so loose that every point meets it, its
    JSON, plot and logs under `tmp_path` (NAME.json, NAME.png), and `flags` on top."""
    p = argparse.ArgumentParser()
    add_bench_ladder_args(p)
    return p.parse_args(["--model", "demo", "--slo-ttft-ms", "600000", "--slo-tpot-ms", "600000", "--warmup", "0.2",
                         "--measure", "1.0", "--ramp", "0", "--growth", "2", "--output-json", str(tmp_path / f"{name}.json"),
                         "--plot", str(tmp_path / f"{name}.png"), "--log-dir", str(tmp_path / "logs"), *flags])


def test_ladder_end_to_end_on_the_demo_model(tmp_path):
    """Three rungs on the random demo model, with an SLO so loose that every point meets it: the search grows to
    --max-users, the int8 rung gets quality figures, the planner a prediction, and the JSON and plot are written."""
    args = demo_ladder_args(tmp_path, "ladder", "--rungs", "naive,batching,int8", "--naive", "sieve", "--max-tokens", "8",
                            "--max-users", "3", "--memory-gb", "0.5", "--eval-windows", "1", "--eval-data", str(tmp_path / "eval.txt"))
    (tmp_path / "eval.txt").write_text("The quick brown fox jumps over the lazy dog. " * 80)
    out = run_ladder(args)
    saved = json.loads((tmp_path / "ladder.json").read_text())
    validate_ladder(saved)
    assert [r["key"] for r in saved["rungs"]] == ["naive", "batching", "int8"]
    assert [r["users"] for r in saved["rungs"]] == [3, 3, 3]
    assert [p["users"] for p in saved["rungs"][0]["probes"]] == [1, 2, 3]
    assert saved["rungs"][1]["probes"][0]["users"] == 3  # a rung's search starts at the previous rung's capacity
    assert saved["rungs"][0]["quality"] is None and saved["rungs"][2]["quality"]["tokens_scored"] > 0
    # int8 linears: half the bf16 linears' bytes plus scales; the rest unchanged (so more than half in all)
    assert 0.5 * saved["rungs"][1]["weight_bytes"] < saved["rungs"][2]["weight_bytes"] < saved["rungs"][1]["weight_bytes"]
    assert saved["rungs"][2]["kv_pool_gb"] > saved["rungs"][1]["kv_pool_gb"]  # lighter weights leave more KV memory
    assert all(r["planner"]["users"] >= 0 for r in saved["rungs"]) and out["rungs"][2]["factor"] == 1.0
    assert (tmp_path / "ladder.png").stat().st_size > 1000


def test_naive_server_streams_one_request_at_a_time_and_refuses_what_it_does_not_implement(demo_dir, tmp_path):
    """The naive rung's server (transformers `generate`) with the `openai` client: a streamed chat answer with
    usage, the same greedy answer unstreamed, and OpenAI-style errors for an unknown field and a bad value."""
    import sys

    import openai

    from sieve.bench.llama_cpp import Server, free_port

    port = free_port()
    cmd = [sys.executable, "-m", "sieve.bench.naive_server", "--model", str(demo_dir), "--port", str(port),
           "--served-model-name", "bench"]
    with Server(cmd, port, tmp_path / "naive.log", timeout=300) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        messages = [{"role": "user", "content": "Hello there"}]
        stream = client.chat.completions.create(model="bench", messages=messages, max_tokens=6, temperature=0,
                                                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens > 0
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        whole = client.chat.completions.create(model="bench", messages=messages, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert whole.choices[0].message.content == streamed and whole.usage.completion_tokens == 6
        with pytest.raises(openai.BadRequestError, match="does not support: top_p"):
            client.chat.completions.create(model="bench", messages=messages, max_tokens=4, top_p=0.5)
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.chat.completions.create(model="bench", messages=messages, max_tokens=0)
        with pytest.raises(openai.BadRequestError, match="each message"):
            client.chat.completions.create(model="bench", messages=[{"role": "user", "content": 5}], max_tokens=4)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="other", messages=messages, max_tokens=4)


def test_long_workload_documents_and_sessions():
    """The long workload: wikitext-2 articles cut into documents of MIN to MAX tokens (a whitespace count here), each
    different, and retrieval conversations that carry one each under the retrieval system prompt."""
    from sieve.bench.ladder import QUESTIONS, RETRIEVAL_PROMPT, long_sessions
    from sieve.prompts import documents

    count = lambda text: len(text.split())  # noqa: E731
    docs = documents(count, 300, 600, 6, seed=1)
    assert len(docs) == 6 and len(set(docs)) == 6
    assert all(300 <= sum(count(line) + 1 for line in d.splitlines()) <= 600 for d in docs)
    assert docs[0].startswith("# ")  # the first article's title
    sessions = long_sessions(10, 0, 32, 2, docs)
    assert all(s.system == RETRIEVAL_PROMPT and s.chat and len(s.turns) == 2 for s in sessions)
    assert all(any(d in s.turns[0].user for d in docs) and s.turns[0].user.endswith(tuple(QUESTIONS)) for s in sessions)


def test_each_workload_takes_its_own_slo_and_memory():
    from sieve.bench.ladder import per_workload

    p = argparse.ArgumentParser()
    add_bench_ladder_args(p)
    chat, long = per_workload(p.parse_args(["--workload", "chat,long", "--memory-gb", "0.6,0.4", "--slo-ttft-ms", "2000,10000"]))
    assert (chat.workload, chat.memory_gb, chat.slo_ttft_ms, chat.slo_tpot_ms) == ("chat", 0.6, 2000, 100)
    assert (long.workload, long.memory_gb, long.slo_ttft_ms, long.slo_tpot_ms) == ("long", 0.4, 10000, 100)
    with pytest.raises(SystemExit):
        p.parse_args(["--workload", "chat,essay"])


def test_two_workloads_in_one_json_and_one_plot(tmp_path):
    """chat and long on the demo model (documents of 600 to 900 tokens), with an SLO every point meets: one JSON holding
    both ladders, each valid, the long one's prompts carrying its documents, and one plot."""
    run_ladder(demo_ladder_args(tmp_path, "ladders", "--workload", "chat,long", "--rungs", "batching", "--max-tokens", "4",
                                "--max-users", "2", "--memory-gb", "0.5,0.4", "--doc-tokens", "600,900"))
    saved = json.loads((tmp_path / "ladders.json").read_text())
    assert saved["schema"] == "sieve.bench.ladders/1"
    chat, long = saved["ladders"]
    for ladder in (chat, long):
        validate_ladder(ladder)
    assert (chat["workload"]["kind"], long["workload"]["kind"]) == ("chat", "long")
    assert (chat["memory_gb"], long["memory_gb"]) == (0.5, 0.4)
    assert long["workload"]["mean_prompt_tokens"] > 600 > chat["workload"]["mean_prompt_tokens"]
    assert (tmp_path / "ladders.png").stat().st_size > 1000
    # each batching rung's planner is calibrated by its probes; --replan recomputes that from the file alone
    assert all(lad["rungs"][0]["planner"]["calibrated"]["calibration"]["p99_over_mean"] >= 1 for lad in (chat, long))
    p = argparse.ArgumentParser()
    add_bench_ladder_args(p)
    again = run_ladder(p.parse_args(["--replan", str(tmp_path / "ladders.json"), "--output-json", str(tmp_path / "again.json")]))
    assert [lad["workload"]["kind"] for lad in again["ladders"]] == ["chat", "long"]
    assert json.loads((tmp_path / "again.json").read_text())["ladders"][1]["rungs"][0]["users"] == long["rungs"][0]["users"]


def test_repeats_measure_a_rung_again_and_report_the_median(monkeypatch, tmp_path):
    """--repeats 2: the rung is measured twice (a fresh server each; here a stand-in that finds 3, then 6 users),
    the second search starts at the first capacity, users is the median (4.5), every repeat's probes are kept and
    checked, and a median that does not match its repeats is refused."""
    from sieve.bench import ladder
    from sieve.bench.serving_stats import SLO

    starts = []

    def once(args, served, rung, i, rep, o, kv_gb, start, log_dir, slo):
        starts.append(start)
        cap = (3, 6)[rep]
        probes = [{"users": u, "within_slo": u <= cap, "ttft_p99_ms": 1.0, "tpot_p99_ms": 1.0, "output_tokens_per_s": 1.0,
                   "requests": 4, "mean_prompt_tokens": 100.0, "mean_output_tokens": 10.0} for u in (cap, cap + 1)]
        return {"users": cap, "at_capacity": probes[0], "probes": probes, "seconds": 1.0, "spec_acceptance_rate": None}, ["x", "y", "serve"]

    monkeypatch.setattr(ladder, "measure_once", once)
    p = argparse.ArgumentParser()
    add_bench_ladder_args(p)
    args = p.parse_args(["--repeats", "2"])
    rung = next(r for r in RUNGS if r.key == "batching")
    means = {"prompt": [], "output": []}
    res = ladder.measure_rung(args, "m", rung, 1, {}, 1000, 2, tmp_path, SLO(2.0, 0.1), means)
    assert starts == [2, 3] and res["users"] == 4.5 and [r["users"] for r in res["repeats"]] == [3, 6]
    assert len(res["probes"]) == 4 and len(means["prompt"]) == 4
    assert ladder.median_users([3, 6]) == 4.5 and ladder.median_users([4, 4]) == 4 and ladder.median_users([1, 5, 9]) == 5
    out = _ladder()
    out["rungs"][1].update(users=res["users"], repeats=res["repeats"], probes=res["probes"])
    validate_ladder(out)
    out["rungs"][1]["users"] = 6
    with pytest.raises(ValueError, match="not the median of its repeats"):
        validate_ladder(out)
    with pytest.raises(Exception, match="--repeats must be > 0"):
        run_ladder(p.parse_args(["--repeats", "0"]))


def test_at_users_measures_each_rung_at_one_load_with_the_repeats_interleaved(monkeypatch, tmp_path):
    """--at-users 30 --repeats 2: no search; every rung once at 30 users, then every rung again (a fresh server each),
    so that a machine's drift between the first and the last minutes falls on both rungs; the medians per rung."""
    from sieve.bench import ladder

    calls = []

    def once(args, served, rung, i, rep, o, kv_gb, start, log_dir, slo, search=True):
        calls.append((rung.key, rep, start, search))
        tok_s = {"speculative": 400.0, "kv-fp8": 380.0}[rung.key] + 10 * rep
        probe = {"users": start, "within_slo": rep == 0, "ttft_p50_ms": 500.0, "ttft_p99_ms": 1500.0 + 1000 * rep,
                 "tpot_p99_ms": 80.0, "output_tokens_per_s": tok_s, "requests": 100}
        return {"users": start if rep == 0 else 0, "at_capacity": probe, "probes": [probe], "seconds": 1.0,
                "spec_acceptance_rate": 0.8}, ["x", "y", "serve", rung.key]

    monkeypatch.setattr(ladder, "measure_once", once)
    p = argparse.ArgumentParser()
    add_bench_ladder_args(p)
    out = run_ladder(p.parse_args(["--rungs", "speculative,kv-fp8", "--at-users", "30", "--repeats", "2",
                                   "--output-json", str(tmp_path / "ab.json"), "--log-dir", str(tmp_path)]))
    assert calls == [("speculative", 0, 30, False), ("kv-fp8", 0, 30, False), ("speculative", 1, 30, False), ("kv-fp8", 1, 30, False)]
    assert json.loads((tmp_path / "ab.json").read_text()) == out
    assert [(p["key"], p["repeat"]) for p in out["points"]] == [("speculative", 0), ("kv-fp8", 0), ("speculative", 1), ("kv-fp8", 1)]
    assert out["summary"]["kv-fp8"] == {"within_slo": 1, "repeats": 2, "output_tokens_per_s_median": 385.0,
                                        "ttft_p50_ms_median": 500.0, "ttft_p99_ms_median": 2000.0, "tpot_p99_ms_median": 80.0}
    assert out["at_users"] == 30 and out["schema"] == ladder.FIXED_SCHEMA_ID


def test_w8a8_rung_is_measured_when_named_beside_int8():
    """The W8A8 rung (issue 63) serves `--quantization w8a8` and plans with int8's bytes at the int8 rate; the default
    ladder leaves it out, `--rungs ...,int8,w8a8` measures it right after int8 (its gain is over int8)."""
    from sieve.bench.ladder import engine_options, per_workload, select_rungs

    p = argparse.ArgumentParser()
    add_bench_ladder_args(p)
    assert "w8a8" not in p.parse_args(["--model", "demo"]).rungs.split(",")
    keys = [r.key for r in select_rungs(per_workload(p.parse_args(["--model", "demo", "--rungs", "w8a8,int8,prefix"]))[0])]
    assert keys == ["prefix", "int8", "w8a8"]
    w8a8 = next(r for r in RUNGS if r.key == "w8a8")
    assert w8a8.lossy and w8a8.prefix and not w8a8.spec
    assert engine_options(w8a8, native_int4=True) == {"dtype": "bfloat16", "enable_prefix_caching": True,
                                                      "dequantize": True, "quantization": "w8a8"}


def test_kv_press_rung_serves_its_press_and_leaves_quality_to_its_benchmark():
    """The KV compression rung (issue 65) is named, not measured by default; its server gets --kv-compression, and
    `sieve eval` (which scores prompts: no press runs there) does not pretend to measure it."""
    from sieve.bench.ladder import engine_options, serve_flags

    p = argparse.ArgumentParser()
    add_bench_ladder_args(p)
    assert "kv-press" not in p.parse_args(["--model", "demo"]).rungs.split(",")
    press = next(r for r in RUNGS if r.key == "kv-press")
    o = engine_options(press, native_int4=True)
    assert o["kv_compression"] == "snapkv:0.5" and o["quantization"] == "int8"
    flags = serve_flags(o)
    assert flags[flags.index("--kv-compression") + 1] == "snapkv:0.5"


@pytest.mark.parametrize("shape", ["qwen2.5-0.5b", "llama-3.2-1b", "smollm2-135m"])
def test_random_bench_checkpoints_are_what_transformers_reads(shape, tmp_path, monkeypatch):
    """The benchmarks' random checkpoints (sieve/bench/checkpoints.py: the GPU scripts' Llama-3.2-1B and SmolLM2-135M
    shapes, the offline bench's Qwen2.5-0.5B) keep their published config's architecture: biases where Qwen2 has them, Llama's head_dim
    and llama3-scaled rotary; shrunk here, written in float32 with std-1 weights (so greedy decisions are clear), and
    sieve's greedy tokens and logprobs are transformers' own."""
    import sieve.bench.checkpoints as ckpt
    from reference import assert_matches, greedy_reference
    from sieve import LLM, SamplingParams

    small = dict(ckpt.SHAPES[shape], hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    if "head_dim" in small:
        small["head_dim"] = 16
    monkeypatch.setitem(ckpt.SHAPES, shape, small)
    path = ckpt.make_random_checkpoint(tmp_path / shape, shape, tokenizer=False, std=1.0)
    prompts = [[5, 9, 33, 100, 7], [300, 12, 8, 8, 41, 2, 17]]
    llm = LLM(str(path), dtype="float32", device="cpu", skip_tokenizer_init=True, num_gpu_blocks_override=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5))
    ref_tokens, ref_logprobs = greedy_reference(path, prompts, 8)
    assert_matches(outs, ref_tokens, ref_logprobs, shape)
