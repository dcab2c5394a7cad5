"""The OpenAI-compatible server, driven by the real `openai` client against a live server on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest

API_KEY = "test-key"
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(llama_dir):
    import uvicorn

    from sieve import EngineConfig, LLMEngine
    from sieve.server.app import create_app

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=256, max_model_len=512))
    app = create_app(engine, served_model_name=MODEL, api_key=API_KEY)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY)


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}
    assert "version" in httpx.get(server[0] + "/version").json()


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
        return await asyncio.gather(*[
            aclient.completions.create(model=MODEL, prompt=[5 + i] * (3 + i), max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
            for i in range(8)
        ])

    assert all(r.usage.completion_tokens == 6 for r in asyncio.run(run()))


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
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    # still serving afterwards, with nothing left behind
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    engine = server[1]
    deadline = time.time() + 5
    while engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.05)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
