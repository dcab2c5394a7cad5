"""The expected wait (sieve/queue_eta.py): the estimate made when a request queues against when it then starts, on a
virtual clock that charges each step what the injected step cost says (so no machine's speed matters); the server's
queue headers, the stream's queue comment and its final metrics.queue_ms."""

from __future__ import annotations

import httpx
import pytest

from live_server import API_KEY, MODEL, start_server
from sieve import EngineConfig, LLMEngine, SamplingParams


class FixedCost:
    """A step of n tokens takes 10 ms + 0.5 ms per token."""

    ready = True

    def predict(self, num_tokens: float, keys: float = 0.0) -> float:
        return 0.010 + 0.0005 * num_tokens


@pytest.mark.parametrize("budget", [512, 24])  # prompts in one step, and chunked beside the decodes
def test_the_estimate_is_when_the_request_then_starts(llama_dir, budget):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=256, max_model_len=256,
                                    max_num_seqs=3, max_num_batched_tokens=budget, enable_prefix_caching=False))
    cost = FixedCost()
    engine.queue_eta.cost = cost
    schedule, clock = engine.scheduler.schedule, [0.0]

    def timed():  # the virtual clock: each step costs what the model says of its tokens
        out = schedule()
        clock[0] += cost.predict(out.num_batched_tokens) if not out.is_empty else 0.0
        return out

    engine.scheduler.schedule = timed
    estimates, started, first_token = {}, {}, {}
    for i in range(10):
        params = SamplingParams(temperature=0, max_tokens=8 + 3 * (i % 4), ignore_eos=True)
        engine.add_request(f"r{i}", {"prompt_token_ids": [7 + i] * (20 + 5 * i)}, params)
        estimates[f"r{i}"] = engine.queue_estimate(f"r{i}")
    assert [estimates[f"r{i}"].position for i in range(10)] == list(range(10))
    while engine.has_unfinished():
        before = clock[0]
        outs = engine.step()
        for s in engine.scheduler.running:
            started.setdefault(s.request.request_id, before)
        for out in outs:
            first_token.setdefault(out.request_id, clock[0])
    errors = [abs(estimates[r].start_s - started[r]) for r in started]
    ttft_errors = [abs(estimates[r].first_token_s - first_token[r]) for r in started]
    assert max(errors) < 0.05 * max(started.values()) + 0.02, (errors, started)  # within a step or two
    assert max(ttft_errors) < 0.05 * max(first_token.values()) + 0.02
    assert sorted(started.values())[-1] > 0.3  # (the last ones did wait)


def test_queue_headers_and_the_streams_queue_comment(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=256, max_model_len=256))
    url, stop = start_server(engine)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        for prompt in ("hi", "hello there, my friend", "a longer prompt " * 8):  # steps of several sizes measured
            httpx.post(url + "/v1/completions", headers=headers, json={"prompt": prompt, "max_tokens": 4}, timeout=60)
        assert engine.step_timer.ready
        r = httpx.post(url + "/v1/completions", headers=headers, json={"prompt": "hello", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
        assert r.headers["x-sieve-queue-position"] == "0" and int(r.headers["x-sieve-queue-eta-ms"]) >= 0
        assert int(r.headers["x-sieve-ttft-eta-ms"]) >= 0 and float(r.headers["x-sieve-queue-ms"]) >= 0
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True,
                "stream_options": {"include_queue": True, "include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", headers=headers, json=body, timeout=60) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[0].startswith(": queue queue-position=0 queue-eta-ms=")
        import json

        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["choices"] == [] and last["metrics"]["queue_ms"] >= 0 and lines[-1] == "data: [DONE]"
        # OpenAI's client reads such a stream as any other (the comment skipped, the extra field kept)
        import openai

        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
        chunks = list(client.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True,
                                                extra_body={"stream_options": {"include_queue": True}}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) and chunks[-1].model_extra["metrics"]["queue_ms"] >= 0
    finally:
        stop()


def test_a_waiting_stream_is_told_its_expected_wait_again_as_it_falls(llama_dir, monkeypatch):
    """One running slot, held by a 150-token request: a stream that asks for include_queue waits behind it, and is
    told its expected wait at once and again every QUEUE_UPDATE_S (0.2 s here) until its first token, the later
    estimates nearer its start (the step cost injected: no machine's speed matters); then it streams as usual."""
    import re
    import threading
    import time

    import sieve.server.routes as routes

    monkeypatch.setattr(routes, "QUEUE_UPDATE_S", 0.2)
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=256, max_model_len=256,
                                    max_num_seqs=1))
    engine.queue_eta.cost = FixedCost()
    url, stop = start_server(engine)
    aengine = stop.app.state.async_engine
    headers = {"Authorization": f"Bearer {API_KEY}"}
    aengine.step_delay = 0.02  # (150 tokens: 3 s)
    try:
        hold = threading.Thread(target=httpx.post, args=(url + "/v1/completions",), kwargs=dict(
            headers=headers, json={"prompt": "hold", "max_tokens": 150, "ignore_eos": True}, timeout=60))
        hold.start()
        deadline = time.monotonic() + 30
        while not engine.scheduler.running:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True, "stream_options": {"include_queue": True}}
        with httpx.stream("POST", url + "/v1/completions", headers=headers, json=body, timeout=60) as s:
            lines = [line for line in s.iter_lines() if line]
        hold.join()
    finally:
        aengine.step_delay = 0
        stop()
    comments = [line for line in lines if line.startswith(": queue ")]
    assert lines[: len(comments)] == comments and lines[-1] == "data: [DONE]"  # every comment before the first chunk
    etas = [int(re.search(r"queue-eta-ms=(\d+)", c).group(1)) for c in comments]
    assert len(comments) >= 4 and etas[-1] < etas[0] / 2, etas
