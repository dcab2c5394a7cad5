"""The OpenAI-compatible server, driven by the real `openai` client against a live server on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import openai
import pytest

from live_server import API_KEY, MODEL, faulty_engine, metrics_page, start_server, wait_idle


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY)


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}
    assert "version" in httpx.get(server[0] + "/version").json()
    assert httpx.get(server[0] + "/version").json()["slo"] == {"ttft_ms": None, "tpot_ms": None, "reject": False}  # this engine has none


def test_completion_fields_and_usage(client, server):
    r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 12
    tok = server[1].tokenizer
    assert r.usage.prompt_tokens == len(tok.encode("def f(x):"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    echo = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert echo.choices[0].text == "def f(x):" + c.text


def test_streamed_text_equals_non_streamed(client):
    kw = dict(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=20, temperature=0.8, seed=11, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == 4
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_chat_sync_and_stream_with_logprobs(client):
    msgs = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.message.role == "assistant" and len(c.logprobs.content) == 8
    assert all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        if ch.choices
    )
    assert streamed == c.message.content


def test_n_and_stop(client):
    r = client.completions.create(model=MODEL, prompt="x = ", max_tokens=10, n=3, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 30
    full = client.completions.create(model=MODEL, prompt="x = ", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:8]
    cut = client.completions.create(model=MODEL, prompt="x = ", max_tokens=20, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_async_client_concurrent(server):
    import asyncio

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=API_KEY)
        plain = await asyncio.gather(*[
            aclient.completions.create(model=MODEL, prompt=[5 + i] * (3 + i), max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
            for i in range(8)
        ])

        async def streamed(i):
            stream = await aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=6, temperature=0.9, seed=i,
                stream=True, extra_body={"ignore_eos": True})
            return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

        texts = await asyncio.gather(*(streamed(i) for i in range(4)))
        whole = await asyncio.gather(*(aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=6, temperature=0.9, seed=i,
            extra_body={"ignore_eos": True}) for i in range(4)))
        return plain, texts, [w.choices[0].message.content for w in whole]

    plain, texts, whole = asyncio.run(run())
    assert all(r.usage.completion_tokens == 6 for r in plain)
    assert texts == whole  # async streaming gives the same text as async non-streaming, same seeds


def test_errors_have_openai_shape(server, client):
    base = server[0]
    h = {"Authorization": f"Bearer {API_KEY}"}
    cases = [
        (httpx.post(base + "/v1/completions", content=b"{not json", headers={**h, "content-type": "application/json"}), 400),
        (httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": "many"}, headers=h), 400),
        (httpx.post(base + "/v1/completions", json={"model": "nope", "prompt": "hi"}, headers=h), 404),
        (httpx.post(base + "/v1/completions", json={"prompt": [1] * 600}, headers=h), 400),
        (httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 0}, headers=h), 400),
        (httpx.post(base + "/v1/completions", json={"prompt": "hi"}), 401),
        (httpx.post(base + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"}), 401),
    ]
    for resp, status in cases:
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "512" in cases[3][0].json()["error"]["message"]
    # an internal failure (here: a tokenizer that raises) is a 500 in the same shape, and serving goes on
    engine = server[1]
    real_encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("tokenizer exploded"))
    try:
        resp = httpx.post(base + "/v1/completions", json={"prompt": "hi"}, headers=h)
    finally:
        engine.tokenizer.encode = real_encode
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    # still serving afterwards, with nothing left behind
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    engine = server[1]
    deadline = time.time() + 5
    while engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.05)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_metrics_count_requests_tokens_and_latencies(server, client):
    before = metrics_page(server[0])
    client.completions.create(model=MODEL, prompt=[9, 8, 7], max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    text = metrics_page(server[0])

    def value(name: str, page: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(name))

    assert value('sieve:request_success_total{finished_reason="length"', text) >= value('sieve:request_success_total{finished_reason="length"', before) + 1
    assert value("sieve:generation_tokens_total", text) >= value("sieve:generation_tokens_total", before) + 5
    assert value("sieve:prompt_tokens_total", text) >= value("sieve:prompt_tokens_total", before) + 3
    for hist in ("sieve:time_to_first_token_seconds_count", "sieve:time_per_output_token_seconds_count", "sieve:e2e_request_latency_seconds_count",
                 *(f"sieve:request_{phase}_time_seconds_count" for phase in ("queue", "prefill", "decode", "inference"))):
        assert value(hist, text) > value(hist, before)
    # the phases add up: queue + inference is the request's whole time, as prefill + decode is its inference
    total = {phase: value(f"sieve:request_{phase}_time_seconds_sum", text) for phase in ("queue", "prefill", "decode", "inference")}
    assert total["queue"] + total["inference"] == pytest.approx(value("sieve:e2e_request_latency_seconds_sum", text), rel=1e-6)
    assert total["prefill"] + total["decode"] == pytest.approx(total["inference"], rel=1e-6)
    for gauge in ("sieve:num_requests_running", "sieve:num_requests_waiting", "sieve:kv_cache_usage_perc"):
        assert gauge + "{" in text


def aborted_count(base: str) -> float:
    line = next((l for l in metrics_page(base).splitlines()
                 if l.startswith("sieve:request_success_total{") and 'finished_reason="abort"' in l), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def test_non_streaming_client_that_gives_up_frees_its_blocks(server):
    engine = server[1]
    aborted = aborted_count(server[0])
    with pytest.raises(httpx.ReadTimeout):  # 16 prompts x 480 tokens take seconds; the client waits 0.2 s
        httpx.post(server[0] + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=0.2,
                   json={"prompt": [[3 + i] * 8 for i in range(16)], "max_tokens": 480, "ignore_eos": True})
    wait_idle(engine)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert aborted_count(server[0]) == aborted + 16, "the requests must be aborted, not run to their end"


def test_overload_answers_429_with_retry_after(llama_dir):
    import asyncio

    from sieve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_num_seqs=1))
    url, stop = start_server(engine, max_waiting=2)
    try:
        async def one(client, i):
            return await client.post(url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                                     json={"prompt": [5 + i] * 4, "max_tokens": 40, "ignore_eos": True})

        async def burst():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(one(client, i) for i in range(12)))

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) <= {200, 429}
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "queue_full"
        wait_idle(engine)
        ok = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"prompt": [1, 2], "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200  # still serving once the queue drains
        assert "sieve:request_rejected_total" in metrics_page(url)
    finally:
        stop()


def test_load_64_streams_a_third_disconnecting(server):
    """64 concurrent streaming clients; every third hangs up after a few chunks. The rest get complete
    answers, and afterwards nothing runs, nothing waits and every KV block is free."""
    import asyncio
    import json as _json
    import random

    base, engine = server
    rng = random.Random(0)
    plan = [(i, rng.randint(2, 12) if i % 3 == 0 else None) for i in range(64)]
    aborted = aborted_count(base)

    async def client_run(client, i, hang_up_after):
        # those that hang up ask for far more tokens than they read: only an abort ends them early
        body = {"prompt": [10 + i % 50] * (3 + i % 20), "max_tokens": 24 if hang_up_after is None else 400,
                "stream": True, "ignore_eos": True, "temperature": 0.7, "seed": i}
        text, finish, chunks = "", None, 0
        async with client.stream("POST", base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = _json.loads(line[6:])
                chunks += 1
                text += chunk["choices"][0]["text"]
                finish = chunk["choices"][0]["finish_reason"] or finish
                if hang_up_after is not None and chunks >= hang_up_after:
                    return i, None  # leaving the block closes the connection mid-stream
        return i, (text, finish)

    async def run_all():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(client_run(client, i, k) for i, k in plan))

    results = dict(asyncio.run(run_all()))
    completed = [i for i, k in plan if k is None]
    assert all(results[i] is not None and results[i][1] == "length" for i in completed)
    wait_idle(engine, timeout=20)
    page = metrics_page(base)
    assert 'sieve:num_requests_running{model_name="tiny-llama"} 0.0' in page
    assert 'sieve:num_requests_waiting{model_name="tiny-llama"} 0.0' in page
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert aborted_count(base) == aborted + sum(1 for _, k in plan if k is not None)
    # the completed answers are whole: same text as the same seeded request made without streaming
    sample = completed[0]
    ref = httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60, json={
        "prompt": [10 + sample % 50] * (3 + sample % 20), "max_tokens": 24, "ignore_eos": True, "temperature": 0.7, "seed": sample})
    assert ref.json()["choices"][0]["text"] == results[sample][0]


def test_sigterm_lets_short_requests_finish_and_aborts_the_rest(llama_dir):
    import json as _json
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sieve.cli", "serve", "--model", str(llama_dir), "--dtype", "float32", "--port", str(port),
         "--shutdown-grace", "4", "--kv-cache-memory-gb", "0.05"],
        # every step takes at least 50 ms: the short request (20 steps) finishes inside the 4 s grace period and
        # the long one (480 steps, 24 s) cannot, on any CPU
        env={**os.environ, "SIEVE_DEBUG_STEP_DELAY": "0.05"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600  # the first server of a session may build the native kernels
        while time.time() < deadline and proc.poll() is None:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        results: dict = {}

        def long_stream():  # 16 choices x 480 tokens: 480 steps, far beyond the grace period
            with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
                    "prompt": [5] * 4, "max_tokens": 480, "n": 16, "stream": True, "ignore_eos": True}) as r:
                results["long"] = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

        def short():
            results["short"] = httpx.post(base + "/v1/completions", timeout=60,
                                          json={"prompt": [6] * 4, "max_tokens": 20, "ignore_eos": True}).json()

        threads = [threading.Thread(target=long_stream), threading.Thread(target=short)]
        threads[0].start()
        time.sleep(0.3)
        threads[1].start()
        while 'sieve:num_requests_running{model_name="' in (page := metrics_page(base)) and \
                not any(l.startswith("sieve:num_requests_running") and float(l.split()[-1]) >= 17 for l in page.splitlines()):
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.15)
        with pytest.raises(httpx.ConnectError):  # no new connections once shutting down
            httpx.get(base + "/health", timeout=2)
        for t in threads:
            t.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        assert results["short"]["choices"][0]["finish_reason"] == "length"  # finished within the grace period
        events = results["long"]
        assert events[-1] == "[DONE]"
        finishes = [c["finish_reason"] for e in events[:-1] for c in _json.loads(e)["choices"] if c["finish_reason"]]
        assert sorted(set(finishes)) == ["abort"] and len(finishes) == 16  # each choice told it was cut off
    finally:
        if proc.poll() is None:
            proc.kill()


def test_every_sampling_field_has_its_effect(client):
    base = dict(model=MODEL, prompt=[21, 22, 23], max_tokens=40, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **base).choices[0].text
    sampled = client.completions.create(temperature=1.0, seed=5, **base).choices[0].text
    assert sampled != greedy  # temperature and seed act

    def with_extra(**extra):
        kw = dict(base, extra_body={"ignore_eos": True, **extra})
        return client.completions.create(temperature=1.0, seed=5, **kw).choices[0].text

    assert with_extra(top_k=1) == greedy
    assert client.completions.create(temperature=1.0, seed=5, top_p=0.001, **base).choices[0].text == greedy
    assert with_extra(min_p=1.0) == greedy

    tok_plain = client.completions.create(temperature=0, logprobs=0, **base).choices[0].logprobs.tokens
    tok_pen = client.completions.create(temperature=0, presence_penalty=2.0, frequency_penalty=2.0, logprobs=0, **base).choices[0].logprobs.tokens
    assert len(set(tok_pen)) > len(set(tok_plain))

    lp = client.completions.create(temperature=0, logprobs=3, **base).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 40
    assert all(3 <= len(t) <= 4 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5,
                                          temperature=0, user="someone", extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"


def test_prompt_forms_echo_stream_and_one_choice_per_chunk(client):
    two = client.completions.create(model=MODEL, prompt=["def a():", "class B:"], max_tokens=4, n=2, temperature=1.0, seed=1,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3] and two.usage.completion_tokens == 16
    chunks = list(client.completions.create(model=MODEL, prompt="def a():", max_tokens=4, n=2, temperature=1.0, seed=1, stream=True,
                                            echo=True, extra_body={"ignore_eos": True}))
    assert all(len(ch.choices) == 1 for ch in chunks)
    for i in (0, 1):
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i)
        assert text.startswith("def a():") and text == "def a():" + two.choices[i].text


def test_ignore_eos_through_the_server(llama_dir, tmp_path):
    import shutil

    from sieve import EngineConfig, LLMEngine

    path = tmp_path / "eos-model"
    shutil.copytree(llama_dir, path)
    probe = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_gpu_blocks_override=64))
    from sieve import SamplingParams

    probe.add_request("p", {"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    while probe.has_unfinished():
        out = probe.step()
    greedy = out[0].outputs[0].token_ids
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = greedy[3]
    (path / "config.json").write_text(json.dumps(cfg))
    url, stop = start_server(LLMEngine(EngineConfig(model=str(path), dtype="float32", num_gpu_blocks_override=64)))
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
        stopped = c.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=12, temperature=0)
        assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == greedy.index(greedy[3]) + 1
        ignored = c.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 12
    finally:
        stop()


def test_streams_of_several_prompts_interleave(client):
    chunks = list(client.completions.create(model=MODEL, prompt=[[31, 32], [41, 42]], max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    order = [ch.choices[0].index for ch in chunks if ch.choices]
    assert order.index(1) < len(order) - 1 - order[::-1].index(0), "prompt 1 should stream while prompt 0 is still going"
    assert chunks[-1].usage.completion_tokens == 40 and chunks[-1].usage.prompt_tokens == 4
    full = client.completions.create(model=MODEL, prompt=[[31, 32], [41, 42]], max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    for i in (0, 1):
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) == full.choices[i].text


def test_engine_built_by_a_factory_lives_in_the_engine_thread(llama_dir):
    """`sieve serve` hands the app a factory so the engine is built and stepped by one thread (OpenMP
    teams: sieve/server/async_engine.py); the server then works as usual, and a build error reaches the
    caller instead of leaving a thread that never answers."""
    from sieve import EngineConfig, LLMEngine
    from sieve.server.async_engine import AsyncEngine

    built_in = []

    def build():
        built_in.append(threading.current_thread().name)
        return LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=256))

    url, stop = start_server(build)
    try:
        assert built_in == ["sieve-engine"]
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
        r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
    finally:
        stop()
    with pytest.raises(ValueError, match="unsupported"):
        AsyncEngine(lambda: (_ for _ in ()).throw(ValueError("unsupported architecture")))


def test_unimplemented_and_unknown_fields_are_400_naming_the_field(server, client):
    base, h = server[0], {"Authorization": f"Bearer {API_KEY}"}
    refused = [
        ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "no_such_option": 1}, "no_such_option"),
        ("/v1/completions", {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # chat only
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "function_call": "auto"}, "function_call"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, None),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1000}}, None),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999999": 1}}, None),
        ("/v1/completions", {"prompt": "hi", "priority": 3}, "priority"),
    ]
    for path, body, field in refused:
        resp = httpx.post(base + path, json=body, headers=h)
        assert resp.status_code == 400, (body, resp.text)
        err = resp.json()["error"]
        if field is not None:
            assert err["param"] == field and f"`{field}`" in err["message"], err
        else:
            assert "logit_bias" in err["message"], err
    # the no-op values clients send by default pass
    ok = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "best_of": 1, "suffix": None}, headers=h)
    assert ok.status_code == 200, ok.text
    ok = httpx.post(base + "/v1/chat/completions", headers=h, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                                       "response_format": {"type": "text"}, "tool_choice": "none"})
    assert ok.status_code == 200, ok.text


def test_logit_bias_through_the_server(client, server):
    base = dict(model=MODEL, prompt=[21, 22, 23], max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**base).choices[0].text
    tok = server[1].tokenizer
    target = tok.encode(" return", add_special_tokens=False)[0]
    biased = client.completions.create(logit_bias={str(target): 100}, **base).choices[0].text
    assert biased != plain and biased == tok.decode([target] * 6)
    assert client.completions.create(**base).choices[0].text == plain  # nothing carried over to the next request


def test_access_control_key_priority_and_metrics(llama_dir):
    from sieve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=256))
    url, stop = start_server(engine, allow_client_priority=True)
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json={**body, "priority": 5}, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        for wrong in ("Bearer test-ke", "Bearer test-key2", "test-key", "Bearer TEST-KEY", ""):
            assert httpx.post(url + "/v1/completions", json=body, headers={"Authorization": wrong}).status_code == 401
        assert httpx.get(url + "/metrics").status_code == 401  # the key protects /metrics too
        assert "sieve:num_requests_running" in metrics_page(url)
        assert httpx.get(url + "/health").status_code == 200  # health stays open for supervisors
    finally:
        stop()
    url, stop = start_server(engine, metrics_public=True)
    try:
        assert httpx.get(url + "/metrics").status_code == 200
    finally:
        stop()


def test_nan_and_infinite_values_are_400(server):
    h = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    for field in ("temperature", "top_p", "presence_penalty", "repetition_penalty"):
        for literal in ("NaN", "Infinity", "-Infinity"):  # Python's json (FastAPI's parser) reads these
            resp = httpx.post(server[0] + "/v1/completions", content=f'{{"prompt": "hi", "max_tokens": 2, "{field}": {literal}}}', headers=h)
            assert resp.status_code == 400 and field in resp.json()["error"]["message"], (field, literal, resp.text)
    ok = httpx.post(server[0] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=h)
    assert ok.status_code == 200


def test_a_failed_step_reaches_every_affected_client_and_serving_goes_on(llama_dir):
    """Fault injection: the engine's step raises at a chosen call. A stream in flight gets an error
    event (the openai client raises it) and [DONE]; a non-streaming request gets a 500 in OpenAI's shape;
    the next requests are served and no KV block is left behind."""
    engine, state = faulty_engine(llama_dir)
    url, stop = start_server(engine)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, timeout=30, max_retries=0)
        body = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=50, temperature=0, extra_body={"ignore_eos": True})
        state["fail_at"] = state["calls"] + 4  # the request's 4th step: 3 tokens out, then the fault
        got = []
        with pytest.raises(openai.APIError, match="injected fault"):
            for ch in client.completions.create(stream=True, **body):
                got.append(ch.choices[0].text)
        assert 1 <= len(got) <= 4
        state["fail_at"] = state["calls"] + 2
        resp = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 50, "ignore_eos": True},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        assert resp.status_code == 500 and "injected fault" in resp.json()["error"]["message"], resp.text
        assert resp.json()["error"]["type"] == "server_error"
        assert client.completions.create(**body).usage.completion_tokens == 50  # serving goes on
        assert httpx.get(url + "/health").status_code == 200
        wait_idle(engine)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        stop()


def test_a_steps_outputs_reach_their_streams_with_one_wake_up_of_the_event_loop(llama_dir):
    """The engine thread hands a step's outputs to the event loop in one call (one write to its self-pipe, one
    wake-up) instead of one per sequence, each stream still getting its own outputs in order; a finished request
    leaves the table of streams."""
    import asyncio

    from sieve import EngineConfig, LLMEngine, SamplingParams
    from sieve.server.async_engine import AsyncEngine

    aengine = AsyncEngine(LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=256)))
    try:
        async def main():
            loop = asyncio.get_running_loop()
            calls = []
            real = loop.call_soon_threadsafe
            loop.call_soon_threadsafe = lambda *a: calls.append(a[0]) or real(*a)
            params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            streams = await aengine.submit([(f"r{i}", {"prompt_token_ids": [5 + i, 6, 7]}, params, 0) for i in range(4)])
            async def collect(st):
                return [o async for o in st]

            outs = await asyncio.gather(*(collect(st) for st in streams))
            return outs, calls

        outs, calls = asyncio.run(main())
    finally:
        aengine.stop()
    assert [len(o[-1].outputs[0].token_ids) for o in outs] == [6] * 4 and all(o[-1].finished for o in outs)
    for o in outs:  # each stream's outputs in order, one per step
        assert [len(x.outputs[0].token_ids) for x in o] == list(range(1, 7))
    deliveries = [c for c in calls if getattr(c, "__name__", "") == "_put_all"]
    assert len(deliveries) == 6  # one per step (4 sequences each), not 24
    assert not aengine._queues


def test_a_dead_engine_thread_fails_every_client_health_says_503_and_serve_exits_1(llama_dir):
    """Fault injection outside the step (delivering an output): the engine thread dies. The stream in
    flight gets an error event, a request arriving later a 503, /health a 503, and `serve` returns 1."""
    from sieve import EngineConfig, LLMEngine
    from sieve.server.app import create_app
    from sieve.server.serve import serve

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=256))
    app = create_app(engine, served_model_name=MODEL, api_key=API_KEY)
    aengine = app.state.async_engine
    real_deliver, state = aengine._deliver, {"calls": 0}

    def deliver(items):
        state["calls"] += 1
        if state["calls"] == 3:
            raise RuntimeError("delivery exploded")
        return real_deliver(items)

    aengine._deliver = deliver
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    status = {}
    thread = threading.Thread(target=lambda: status.setdefault("rc", serve(app, "127.0.0.1", port, grace=1.0)), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, timeout=30, max_retries=0)
    with pytest.raises(openai.APIError, match="delivery exploded"):
        for _ in client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=50, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
            pass
    assert aengine.error is not None
    thread.join(timeout=30)
    assert status.get("rc") == 1, "an engine that cannot continue ends the process with a non-zero status"
    # what a client would have seen between the death and the exit, asked of the app directly
    from fastapi.testclient import TestClient

    with TestClient(app) as tc:
        health = tc.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        late = tc.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {API_KEY}"})
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_error"


def test_health_is_503_while_a_step_hangs_with_work_queued(llama_dir):
    from sieve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=256))
    real_step, release = engine.step, threading.Event()

    def step():  # a step that hangs until the test lets it go
        release.wait(timeout=60)
        return real_step()

    engine.step = step
    url, stop = start_server(engine, health_stall_seconds=0.3)
    try:
        assert httpx.get(url + "/health").status_code == 200  # idle: nothing queued, not stalled
        h = {"Authorization": f"Bearer {API_KEY}"}
        sender = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=h,
                                                            timeout=60), daemon=True)
        sender.start()
        deadline, health = time.time() + 10, None
        while time.time() < deadline:
            health = httpx.get(url + "/health")
            if health.status_code == 503:
                break
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["status"] == "stalled"
        release.set()
        sender.join(timeout=30)
        wait_idle(engine)
        assert httpx.get(url + "/health").status_code == 200
    finally:
        release.set()
        stop()


def test_models_advertise_the_context_the_kv_cache_can_hold(llama_dir, caplog):
    from sieve import EngineConfig, LLMEngine

    with caplog.at_level("WARNING", logger="sieve"):
        engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=8, max_model_len=256))
    assert engine.config.max_model_len == 8 * 16 and "max_model_len 256 capped to 128" in caplog.text
    url, stop = start_server(engine)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        assert client.models.list().data[0].model_extra["max_model_len"] == 128
        with pytest.raises(openai.BadRequestError, match="maximum context length of 128"):
            client.completions.create(model=MODEL, prompt=[3] * 100, max_tokens=50)
    finally:
        stop()


def test_limits_on_choices_prompts_and_body_size(llama_dir):
    from sieve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=256))
    url, stop = start_server(engine, max_n=4, max_prompts=3, max_body_bytes=2000)
    h = {"Authorization": f"Bearer {API_KEY}"}
    try:
        def post(**kw):
            return httpx.post(url + "/v1/completions", headers={**h, **kw.pop("headers", {})}, timeout=30, **kw)

        assert post(json={"prompt": "hi", "max_tokens": 1, "n": 4}).status_code == 200
        r = post(json={"prompt": "hi", "max_tokens": 1, "n": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = post(json={"prompt": ["a", "b", "c", "d"], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        big = json.dumps({"prompt": "x" * 3000, "max_tokens": 1}).encode()
        r = post(content=big, headers={"content-type": "application/json"})  # by its Content-Length
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = post(content=iter([big[:1000], big[1000:]]), headers={"content-type": "application/json"})  # chunked: counted
        assert r.status_code == 413
        small = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
        r = post(content=iter([small[:5], small[5:]]), headers={"content-type": "application/json"})  # chunked, small: served
        assert r.status_code == 200, r.text
        assert engine.num_waiting == 0
    finally:
        stop()


def test_max_waiting_counts_requests_not_choices(llama_dir):
    from sieve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=256))
    real_step, release = engine.step, threading.Event()

    def step():  # nothing is scheduled until the test lets steps run
        release.wait(timeout=60)
        return real_step()

    engine.step = step
    url, stop = start_server(engine, max_waiting=2)
    h = {"Authorization": f"Bearer {API_KEY}"}
    results = {}

    def send(name, body):
        results[name] = httpx.post(url + "/v1/completions", json=body, headers=h, timeout=60).status_code

    try:
        a = threading.Thread(target=send, args=("a", {"prompt": "hi", "max_tokens": 2, "n": 8, "temperature": 1.0}))
        a.start()
        deadline = time.time() + 10
        while engine.num_waiting < 1 and time.time() < deadline:
            time.sleep(0.02)
        [req] = engine.requests.values()  # one request of 8 choices: the first waits, 7 fork from it after its prefill
        assert engine.num_waiting == 1 and len(engine.scheduler.waiting) == 1 and len(req.unforked) == 7
        b = threading.Thread(target=send, args=("b", {"prompt": "hi", "max_tokens": 2}))
        b.start()
        aengine = stop.app.state.async_engine  # b waits in the engine thread's inbox while the step is held
        while engine.num_waiting + aengine.num_pending < 2 and time.time() < deadline:
            time.sleep(0.02)
        assert engine.num_waiting + aengine.num_pending == 2
        send("c", {"prompt": "hi", "max_tokens": 2})
        assert results["c"] == 429
        release.set()
        a.join(timeout=60)
        b.join(timeout=60)
        assert results["a"] == 200 and results["b"] == 200
    finally:
        release.set()
        stop()


def test_prompts_of_one_request_are_admitted_together_with_their_own_params(server, client, monkeypatch):
    engine = server[1]
    admitted = []
    real = engine.add_request

    def record(rid, prompt, params, priority=0, **kw):
        admitted.append((rid, engine.num_steps, id(params)))
        return real(rid, prompt, params, priority, **kw)

    monkeypatch.setattr(engine, "add_request", record)
    # max_tokens null: each prompt's own room in the context (this once failed: one params object was shared and filled in)
    r = client.completions.create(model=MODEL, prompt=[[5] * 3, [6] * 40, [7] * 9], max_tokens=None, temperature=0,
                                  extra_body={"ignore_eos": True})
    lens = [len(c.text) for c in sorted(r.choices, key=lambda c: c.index)]
    assert r.usage.completion_tokens == 3 * 512 - (3 + 40 + 9) and all(lens)
    assert [c.finish_reason for c in r.choices] == ["length"] * 3
    assert len(admitted) == 3 and len({steps for _, steps, _ in admitted}) == 1  # all before one same step
    assert len({p for _, _, p in admitted}) == 1  # handed over as one object: the engine makes each request's copy


def test_tokenize_and_detokenize_shaped_like_vllm(server):
    base, h = server[0], {"Authorization": f"Bearer {API_KEY}"}
    tok = server[1].tokenizer
    r = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": "def f(x): return x"}, headers=h).json()
    assert r["tokens"] == tok.encode("def f(x): return x") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert r["token_strs"] is None
    strs = httpx.post(base + "/tokenize", json={"prompt": "ab", "add_special_tokens": False, "return_token_strs": True}, headers=h).json()
    assert strs["token_strs"] == tok.convert_ids_to_tokens(tok.encode("ab", add_special_tokens=False))
    chat = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=h).json()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)
    back = httpx.post(base + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}, headers=h).json()
    assert back == {"prompt": tok.decode(r["tokens"])}
    for path, body in [("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}), ("/tokenize", {}),
                       ("/detokenize", {"tokens": [10**9]}), ("/detokenize", {"tokens": [-1]}), ("/tokenize", {"prompt": "a", "x": 1}),
                       ("/tokenize", {"model": "other", "prompt": "a"})]:
        resp = httpx.post(base + path, json=body, headers=h)
        assert resp.status_code in (400, 404) and "error" in resp.json(), (path, body, resp.text)
    assert httpx.post(base + "/tokenize", json={"prompt": "a"}).status_code == 401


def test_tokenization_blocks_neither_the_event_loop_nor_the_engine(server, monkeypatch):
    """A prompt whose tokenization takes as long as we like (held on an event): meanwhile /health answers and
    another request runs to the end, so the tokenizer ran on neither the event loop nor the engine thread."""
    base, engine = server
    h = {"Authorization": f"Bearer {API_KEY}"}
    tok = engine.tokenizer
    real = tok.encode
    held, release = threading.Event(), threading.Event()

    def slow_encode(text, *args, **kwargs):
        if text == "a very long prompt":
            held.set()
            release.wait(30)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", slow_encode)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=httpx.post(base + "/v1/completions", headers=h, timeout=60, json={
        "prompt": "a very long prompt", "max_tokens": 2})))
    t.start()
    try:
        assert held.wait(30)
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        other = httpx.post(base + "/v1/completions", headers=h, timeout=30,
                           json={"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True}).json()
        assert other["usage"]["completion_tokens"] == 8
        assert "r" not in result  # still being tokenized
    finally:
        release.set()
        t.join(timeout=30)
    assert result["r"].status_code == 200


def test_prompt_token_limit(llama_dir):
    from sieve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64))
    url, stop = start_server(engine, max_prompt_tokens=10)
    h = {"Authorization": f"Bearer {API_KEY}"}
    try:
        for body in ({"prompt": [5] * 11}, {"prompt": "word " * 40}, {"prompt": [[5] * 3, [5] * 11]}):
            r = httpx.post(url + "/v1/completions", headers=h, json=body)
            assert r.status_code == 400 and "--max-prompt-tokens" in r.json()["error"]["message"], r.text
        assert httpx.post(url + "/v1/completions", headers=h, json={"prompt": [5] * 10, "max_tokens": 1}).status_code == 200
    finally:
        stop()


def test_requests_finished_in_a_step_that_then_fails_are_failed_not_lost(llama_dir):
    """Fault injection after a step's tokens: two requests finish in one step and building the second's output raises.
    Before, the first had already left the engine's table, so the failure missed it and its client waited forever;
    now every request of the step gets the error, and serving goes on."""
    from sieve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=256))
    real, state = engine.output_processor.make_output, {"armed": False, "finished": 0}

    def make_output(req):
        out = real(req)
        if state["armed"] and out.finished:
            state["finished"] += 1
            if state["finished"] == 2:
                raise RuntimeError("injected after the tokens")
        return out

    engine.output_processor.make_output = make_output
    url, stop = start_server(engine)
    try:
        h = {"Authorization": f"Bearer {API_KEY}"}
        state["armed"] = True
        r = httpx.post(url + "/v1/completions", headers=h, timeout=30,
                       json={"prompt": [[5, 6, 7], [8, 9, 10]], "max_tokens": 3, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 500 and "injected after the tokens" in r.json()["error"]["message"]
        state["armed"] = False
        assert httpx.post(url + "/v1/completions", headers=h, timeout=30, json={"prompt": [5, 6, 7], "max_tokens": 3}).status_code == 200
        wait_idle(engine)
        assert not engine.requests and not stop.app.state.async_engine._queues
    finally:
        stop()


def test_limits_on_stop_strings_logit_bias_and_prompt_bytes_are_400s_counted(server):
    """2,000 stop strings, a vocabulary-sized logit_bias, a 16 MB prompt (refused before the tokenizer sees it, on
    /v1/completions, chat and /tokenize alike): 400s naming the field, counted in /metrics by limit."""
    base, engine = server
    h = {"Authorization": f"Bearer {API_KEY}"}
    seen = []
    real = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text, *a, **kw: seen.append(len(text)) or real(text, *a, **kw)
    try:
        cases = [("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(2000)]}, "stop"),
                 ("/v1/completions", {"prompt": "hi", "stop": "x" * 5000}, "stop"),
                 ("/v1/completions", {"prompt": "hi", "logit_bias": {str(t): 1 for t in range(engine.arch.vocab_size)}}, "logit_bias"),
                 ("/v1/completions", {"prompt": "x" * ((16 << 20) - 1024)}, "prompt"),
                 ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (15 << 20)}]}, "messages"),
                 ("/tokenize", {"prompt": "x" * (15 << 20)}, "prompt")]
        for path, body, param in cases:
            r = httpx.post(base + path, json=body, headers=h, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, param, r.text[:300])
        assert not any(n > 1 << 20 for n in seen)  # the long prompts never reached the tokenizer
        r = httpx.post(base + "/tokenize", json={"prompt": "hello " * 600}, headers=h)  # tokenized, then over the token limit
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        engine.tokenizer.encode = real
    page = metrics_page(base)
    for limit in ("stop", "logit_bias", "prompt_bytes"):
        assert f'sieve:limit_refusals_total{{limit="{limit}",model_name="{MODEL}"}}' in page


def test_a_slow_reader_is_cut_at_its_backlog_while_other_streams_go_on(llama_dir):
    """A stream nobody reads holds every output (each one the text so far). Past --max-stream-backlog outputs its
    request is aborted, its queue emptied, and reading it raises; the stream read alongside gets every token."""
    import asyncio

    from sieve import EngineConfig, LLMEngine, SamplingParams
    from sieve.server.async_engine import AsyncEngine, EngineError

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=256))
    aengine = AsyncEngine(engine, max_backlog=8)
    try:
        async def main():
            params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
            slow, fast = await aengine.submit([("slow", {"prompt_token_ids": [5, 6, 7]}, params, 0),
                                               ("fast", {"prompt_token_ids": [8, 9, 10]}, params, 0)])
            outs = [o async for o in fast]
            await asyncio.sleep(0.2)
            with pytest.raises(EngineError, match="read too slowly"):
                async for _ in slow:
                    pass
            return outs

        outs = asyncio.run(main())
        assert len(outs[-1].outputs[0].token_ids) == 60 and outs[-1].finished
        assert aengine.num_slow_readers == 1
        wait_idle(engine)
        assert not engine.requests and not aengine._queues and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        aengine.stop()


def test_a_grammar_waiting_behind_slow_compiles_gets_its_own_deadline(llama_dir, monkeypatch):
    """Grammars compile on a pool, and --structured-outputs-compile-timeout counts from a compile's own start: three
    distinct slow schemas (0.6 s each, one worker) do not time out a fast one queued behind them (it waited 1.8 s
    against a 1 s timeout, and failed before). The compile itself runs on llguidance fuel sized to the deadline."""
    import concurrent.futures

    from sieve import EngineConfig, LLMEngine
    from sieve.server.app import ServerLimits
    from sieve.structured import GrammarError, StructuredOutputsParams

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=256))
    with pytest.raises(GrammarError, match="too big"):  # no fuel left for the lexer: the compile stops, it does not hang
        engine.grammars.compile(StructuredOutputsParams(regex="([a-z]{3,40}[0-9]{2,30}){1,50}"), deadline_s=1e-7)
    real = engine.grammars.compile

    def compile(spec, deadline_s=None):
        if spec.kind == "json" and "slow" in json.dumps(spec.json):
            time.sleep(0.6)
        return real(spec, deadline_s=deadline_s)

    monkeypatch.setattr(engine.grammars, "compile", compile)
    url, stop = start_server(engine, grammar_timeout=1.0, limits=ServerLimits(grammar_workers=1))
    try:
        h = {"Authorization": f"Bearer {API_KEY}"}

        def ask(schema):
            body = {"prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
            return httpx.post(url + "/v1/completions", json=body, headers=h, timeout=60)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            slow = [pool.submit(ask, {"type": "object", "properties": {f"slow{i}": {"type": "integer"}}}) for i in range(3)]
            time.sleep(0.1)
            fast = pool.submit(ask, {"type": "object", "properties": {"fast": {"type": "integer"}}})
            assert fast.result().status_code == 200, fast.result().text
            assert all(f.result().status_code == 200 for f in slow)
    finally:
        stop()


def test_odd_fields_and_values_are_400s_naming_the_field(server, client):
    """What was accepted silently or crashed: a misspelt message key (an empty message, 200), image and audio parts
    (dropped), unknown stream_options keys, top_logprobs without logprobs, max_completion_tokens 0 (the whole
    context), an empty prompt (a 500 IndexError). Each is a 400 naming the field; the keys OpenAI's client sends back
    with an assistant message still pass."""
    base, h = server[0], {"Authorization": f"Bearer {API_KEY}"}
    user = {"role": "user", "content": "hi"}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "contnet": "hi"}]}, "messages.0.contnet"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}, "messages.0"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [audio]}]}, "messages.0"),
        ("/v1/chat/completions", {"messages": [user], "stream": True, "stream_options": {"include_usage": True, "x": 1}},
         "stream_options.x"),
        ("/v1/chat/completions", {"messages": [user], "top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [user], "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": [{**user, "audio": {"id": "a"}}]}, "messages.0.audio"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [[5, 6], []]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "cache_salt": ""}, "cache_salt"),
    ]
    for path, body, param in cases:
        r = httpx.post(base + path, json=body, headers=h)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
    echoed = {"role": "assistant", "content": "hello", "refusal": None, "annotations": [], "audio": None, "function_call": None,
              "tool_calls": None}
    r = client.chat.completions.create(model=MODEL, messages=[user, echoed, user], max_tokens=2)
    assert r.choices[0].message.content is not None


def test_tool_calls_only_to_offered_functions_and_one_when_parallel_is_off():
    """A call to a function that was never offered stays content (it is not a tool call the client can run), and under
    parallel_tool_calls false only the first call is one: the rest stay content."""
    from sieve.server.tools import parse_tool_calls

    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(text, {"get_weather", "get_time"})
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"] and "rm_rf" in content
    content, calls = parse_tool_calls(text, {"get_weather", "get_time"}, parallel=False)
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and "get_time" in content


def test_tenants_and_cache_salts_keep_prefix_cache_hits_apart(llama_dir):
    """cache_salt (vLLM's) names a request's blocks under its salt: a hit needs the same salt. A server with several
    tenants' keys salts each tenant apart, so cached_tokens never tells one tenant what another sent; one that shares
    its cache across tenants reports no cached_tokens at all (a hit may be another's)."""
    from sieve import EngineConfig, LLMEngine, LLM, SamplingParams
    from sieve.server.auth import APIKeys

    llm = LLM(str(llama_dir), dtype="float32", num_gpu_blocks_override=128)
    prompt = {"prompt_token_ids": list(range(40, 100))}

    def cached(salt):
        return llm.generate([prompt], SamplingParams(max_tokens=2, cache_salt=salt), use_tqdm=False)[0].num_cached_tokens

    assert cached("alice") == 0 and cached("bob") == 0 and cached(None) == 0
    assert cached("alice") > 0 and cached("bob") > 0 and cached(None) > 0

    keys = APIKeys({"key-a": "alice", "key-b": "bob"})
    long = "the same long system prompt, word after word, " * 8

    def usage(url, key):
        r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"prompt": long, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    for shared in (False, True):
        engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=128, max_model_len=256))
        url, stop = start_server(engine, api_key=keys, shared_prefix_cache=shared)
        try:
            assert usage(url, "key-a") == 0
            hits_before = engine.block_manager.num_hit_tokens
            assert usage(url, "key-b") == 0  # bob's first request: never alice's hit, whatever the cache did
            assert (engine.block_manager.num_hit_tokens > hits_before) == shared
            assert (usage(url, "key-a") > 0) == (not shared)  # alice's own hit, reported where the cache is hers alone
        finally:
            stop()
