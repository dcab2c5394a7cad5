"""The Batch API (--batch-dir; sieve/server/batch_*.py) through the openai client's `files` and `batches`: results
equal the same requests run alone, a malformed line becomes an error-file entry while the rest run, cancel and
expiry are reported, a restart mid-batch loses no request and runs none twice, and batch requests preempted by
interactive ones give what they give alone."""

from __future__ import annotations

import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from live_server import API_KEY, MODEL, start_server
from sieve import EngineConfig, LLMEngine


def engine_for(llama_dir, **kw) -> LLMEngine:
    kw.setdefault("num_gpu_blocks_override", 256)
    return LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", max_model_len=256, **kw))


def lines(n: int, max_tokens: int = 6, bad: bool = False) -> bytes:
    out = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"story number {i}:", "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True}} for i in range(n)]
    text = [json.dumps(x) for x in out]
    if bad:
        text.insert(2, "{this is not json")
        text.append(json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}))
    return ("\n".join(text) + "\n").encode()


def wait_for(client: openai.OpenAI, bid: str, statuses=("completed", "cancelled", "expired"), timeout: float = 120):
    deadline = time.time() + timeout
    while True:
        b = client.batches.retrieve(bid)
        if b.status in statuses:
            return b
        assert time.time() < deadline, b
        time.sleep(0.1)


def results(client: openai.OpenAI, file_id: str | None) -> dict:
    if file_id is None:
        return {}
    return {x["custom_id"]: x for x in map(json.loads, client.files.content(file_id).text.splitlines())}


def metric(url: str, prefix: str) -> float:
    """The value of the /metrics line that starts with `prefix` (0 where there is none yet)."""
    page = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return next((float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(prefix)), 0.0)


@pytest.fixture(scope="module")
def batch_server(llama_dir, tmp_path_factory):
    engine = engine_for(llama_dir)
    url, stop = start_server(engine, batch_dir=str(tmp_path_factory.mktemp("batches")))
    yield url, engine, stop
    stop()


def test_a_batch_gives_what_each_request_gives_alone_and_reports_bad_lines(batch_server):
    url = batch_server[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
    counted = f'sieve:batch_request_success_total{{finished_reason="length",model_name="{MODEL}",tenant="other"}}'
    ttft = f'sieve:time_to_first_token_seconds_count{{model_name="{MODEL}"}}'
    before = metric(url, counted), metric(url, ttft)
    f = client.files.create(file=("in.jsonl", io.BytesIO(lines(6, bad=True))), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                              metadata={"job": "nightly"})
    assert b.status == "in_progress" and b.request_counts.total == 8 and b.metadata == {"job": "nightly"}
    b = wait_for(client, b.id)
    assert b.status == "completed" and b.request_counts.completed == 6 and b.request_counts.failed == 2
    out, errors = results(client, b.output_file_id), results(client, b.error_file_id)
    assert sorted(out) == [f"req-{i}" for i in range(6)]
    assert errors["bad-url"]["error"]["code"] == "invalid_request" and errors[None]["response"] is None
    assert "not JSON" in errors[None]["error"]["message"]
    # the batch's requests are counted as its own, not in the interactive latency histograms
    assert (metric(url, counted), metric(url, ttft)) == (before[0] + 6, before[1])
    for i in (0, 5):  # each answer is the same request's over HTTP
        alone = client.completions.create(model=MODEL, prompt=f"story number {i}:", max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
        body = out[f"req-{i}"]["response"]["body"]
        assert out[f"req-{i}"]["response"]["status_code"] == 200 and body["choices"][0]["text"] == alone.choices[0].text
    listed = client.batches.list(limit=10)
    assert b.id in [x.id for x in listed.data]


def test_a_batch_of_embeddings_gives_what_each_gives_alone(batch_server):
    client = openai.OpenAI(base_url=batch_server[0] + "/v1", api_key=API_KEY)
    texts = [f"document number {i}" for i in range(4)]
    body = "\n".join(json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                                  "body": {"model": MODEL, "input": t, "encoding_format": "float"}}) for i, t in enumerate(texts))
    f = client.files.create(file=("emb.jsonl", io.BytesIO(body.encode())), purpose="batch")
    b = wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h").id)
    assert b.status == "completed" and b.request_counts.completed == 4
    out = results(client, b.output_file_id)
    alone = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    for i, d in enumerate(alone.data):
        assert out[f"e{i}"]["response"]["body"]["data"][0]["embedding"] == pytest.approx(d.embedding, abs=1e-5)


def test_bad_requests_to_the_batch_api_are_named(batch_server, llama_dir):
    url = batch_server[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("in.jsonl", io.BytesIO(lines(1))), purpose="fine-tune")
    f = client.files.create(file=("in.jsonl", io.BytesIO(lines(1))), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="tomorrow")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong").batches.list()
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers={"x-sieve-internal": "guess", "x-sieve-tenant": ""})
    assert r.status_code == 401  # the runner's header is no key
    # a server without --batch-dir says so
    other_url, stop = start_server(engine_for(llama_dir, num_gpu_blocks_override=32))
    try:
        with pytest.raises(openai.NotFoundError, match="batch-dir"):
            openai.OpenAI(base_url=other_url + "/v1", api_key=API_KEY).batches.list()
    finally:
        stop()


def test_cancel_and_expiry_are_reported(batch_server):
    url, engine, stop = batch_server
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
    aengine = stop.app.state.async_engine
    aengine.step_delay = 0.05  # (a long batch: each request 40 steps)
    try:
        f = client.files.create(file=("in.jsonl", io.BytesIO(lines(12, max_tokens=40))), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        cancelled = client.batches.cancel(b.id)
        assert cancelled.status in ("cancelling", "cancelled")
        b = wait_for(client, b.id)
        assert b.status == "cancelled" and b.request_counts.failed > 0
        assert {e["error"]["code"] for e in results(client, b.error_file_id).values()} == {"batch_cancelled"}
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1s")
        b = wait_for(client, b.id)
        assert b.status == "expired" and b.expired_at is not None
        assert "batch_expired" in {e["error"]["code"] for e in results(client, b.error_file_id).values()}
    finally:
        aengine.step_delay = 0


def test_the_runner_reads_only_the_requests_it_sends(tmp_path, monkeypatch):
    """The runner asks for pending requests 20 times a second: the store reads and parses only the `limit` it can send
    (those in flight left out), not every pending line of a large batch."""
    from sieve.server import batch_store
    from sieve.server.batch_store import BatchStore

    store = BatchStore(tmp_path)
    f = store.add_file("t", "batch", "in.jsonl", lines(500))
    bid = store.create_batch("t", f["id"], "/v1/completions", "24h", None)["id"]
    parsed = []
    loads = json.loads
    monkeypatch.setattr(batch_store.json, "loads", lambda text, **kw: parsed.append(1) or loads(text, **kw))
    got = store.pending(bid, {(bid, 0), (bid, 2), ("other", 1)}, 3)
    assert [n for n, _, _ in got] == [1, 3, 4] and got[0][2]["prompt"] == "story number 1:"
    assert len(parsed) == 3
    store.record(bid, 1, True, {"response": {}, "error": None})
    assert [n for n, _, _ in store.pending(bid, set(), 2)] == [0, 2]
    assert store.endpoint(bid) == "/v1/completions"


def test_bench_serve_submits_a_batch_beside_its_load_and_reports_it(batch_server, llama_dir, tmp_path, capsys):
    """`sieve bench serve --batch-requests N --batch-wait`: the batch goes through /v1/files and /v1/batches as the load
    starts, and the run file says what it did; bad values and a server without the Batch API end with status 2."""
    from sieve.cli import main

    out = tmp_path / "r.json"
    common = ["bench", "serve", "--base-url", batch_server[0], "--model", MODEL, "--api-key", API_KEY, "--tokenizer",
              str(llama_dir), "--num-prompts", "3", "--input-len", "8:8", "--output-len", "2:2", "--concurrency", "1",
              "--no-progress"]
    assert main(common + ["--batch-requests", "4", "--batch-output-len", "3", "--batch-wait", "--output-json", str(out)]) == 0
    batch = json.loads(out.read_text())["batch"]
    assert batch["status"] == "completed" and batch["completed"] == 4 and batch["failed"] == 0
    assert 0 <= batch["during_load"]["completed"] <= 4 and batch["output_tokens_per_s"] > 0
    assert main(common + ["--batch-requests", "-1"]) == 2 and main(common + ["--batch-requests", "2", "--batch-output-len", "0"]) == 2


def test_the_benchmark_s_batch_is_one_the_server_takes():
    """`sieve bench serve --batch-requests N` (sieve/bench/batch_load.py) writes N chat requests the store accepts."""
    from sieve.bench.batch_load import batch_lines
    from sieve.server.batch_store import parse_lines

    good, bad = parse_lines(batch_lines(MODEL, 5, 32, seed=1), "/v1/chat/completions")
    assert len(good) == 5 and not bad
    assert all(body["max_tokens"] == 32 and body["messages"][0]["role"] == "user" for _, _, body in good)
    assert batch_lines(MODEL, 5, 32, seed=1) == batch_lines(MODEL, 5, 32, seed=1) != batch_lines(MODEL, 5, 32, seed=2)


def test_a_restart_mid_batch_loses_no_request_and_runs_none_twice(llama_dir, tmp_path):
    from sieve.server.batch_store import BatchStore

    directory = str(tmp_path / "batches")
    url, stop = start_server(engine_for(llama_dir, max_num_seqs=2), batch_dir=directory)  # (one batch request at a time)
    stop.app.state.async_engine.step_delay = 0.03
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
    f = client.files.create(file=("in.jsonl", io.BytesIO(lines(10, max_tokens=20))), purpose="batch")
    bid = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id
    deadline = time.time() + 60
    while client.batches.retrieve(bid).request_counts.completed < 3:
        assert time.time() < deadline
        time.sleep(0.05)
    stop()  # mid-batch: requests in flight are cut
    store = BatchStore(directory)
    done_before = store.batch(None, bid)["request_counts"]["completed"]
    assert 3 <= done_before < 10
    url, stop = start_server(engine_for(llama_dir), batch_dir=directory)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
        b = wait_for(client, bid)
        assert b.status == "completed" and b.request_counts.completed == 10 and b.request_counts.failed == 0
        out = client.files.content(b.output_file_id).text.splitlines()
        assert sorted(json.loads(x)["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(10))  # each once
        assert stop.app.state.batch_runner.num_sent == 10 - done_before  # only what had not finished ran again
        alone = client.completions.create(model=MODEL, prompt="story number 7:", max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert results(client, b.output_file_id)["req-7"]["response"]["body"]["choices"][0]["text"] == alone.choices[0].text
    finally:
        stop()


def test_batch_requests_yield_to_interactive_ones_and_give_what_they_give_alone(llama_dir, tmp_path):
    """A small pool: interactive requests arriving during the batch preempt its requests (the lowest priority), which
    resume and answer what they answer alone; the interactive ones are never preempted for the batch."""
    # 16 blocks of 16: the three interactive requests fit (5 blocks each), not beside the batch's two (5 each): they
    # displace the batch's as they arrive
    engine = engine_for(llama_dir, num_gpu_blocks_override=16, block_size=16, max_num_seqs=4)
    url, stop = start_server(engine, batch_dir=str(tmp_path / "b"))
    stop.app.state.async_engine.step_delay = 0.02
    preempted = []
    preempt = engine.scheduler._preempt

    def recorded(seq, out):
        preempted.append(seq.request.priority)
        preempt(seq, out)

    engine.scheduler._preempt = recorded
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
        f = client.files.create(file=("in.jsonl", io.BytesIO(lines(6, max_tokens=60))), purpose="batch")
        bid = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id
        deadline = time.time() + 30
        while not engine.scheduler.running:
            assert time.time() < deadline
            time.sleep(0.01)
        with ThreadPoolExecutor(3) as pool:  # three at once, while two batch requests run
            interactive = list(pool.map(lambda i: client.completions.create(
                model=MODEL, prompt=f"an interactive question {i} " * 6, max_tokens=30, temperature=0,
                extra_body={"ignore_eos": True}), range(3)))
        stop.app.state.async_engine.step_delay = 0
        b = wait_for(client, bid)
        assert b.request_counts.completed == 6 and preempted and all(p >= 1 << 40 for p in preempted), preempted
        out = results(client, b.output_file_id)
        for i in range(6):
            alone = client.completions.create(model=MODEL, prompt=f"story number {i}:", max_tokens=60, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert out[f"req-{i}"]["response"]["body"]["choices"][0]["text"] == alone.choices[0].text
        assert all(r.usage.completion_tokens == 30 for r in interactive)
    finally:
        stop()


def test_run_batch_offline_answers_every_line_in_order(llama_dir, tmp_path):
    """`sieve run-batch -i -o` (vLLM's): the same answers as the server's, a line per input line in its order, a bad
    line's error among them."""
    from test_cli import run_cli

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(lines(4, bad=True))
    r = run_cli("run-batch", "--model", str(llama_dir), "--dtype", "float32", "--served-model-name", MODEL, "-i", str(src),
                "-o", str(dst))
    assert r.returncode == 0, r.stderr
    assert "4 of 6 requests answered, 2 failed" in r.stderr
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [x["custom_id"] for x in out] == ["req-0", "req-1", None, "req-2", "req-3", "bad-url"]
    from sieve import LLM, SamplingParams

    llm = LLM(str(llama_dir), dtype="float32", num_gpu_blocks_override=64)
    want = llm.generate(["story number 3:"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert out[4]["response"]["body"]["choices"][0]["text"] == want.outputs[0].text
    r = run_cli("run-batch", "--model", str(llama_dir), "-i", str(tmp_path / "missing.jsonl"), "-o", str(dst))
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_sieve_serve_stops_on_a_batch_dir_it_cannot_write(llama_dir):
    from test_cli import run_cli

    r = run_cli("serve", "--model", str(llama_dir), "--batch-dir", "/proc/sieve-batches")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "sieve-batches" in r.stderr
