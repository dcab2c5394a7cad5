"""Tenants (--tenants FILE, sieve/server/tenants.py): keys plain or as sha256, tiers served in order, per-tenant
limits answered with 429 and Retry-After, prefix caches apart unless shared, per-tenant metrics, and a file that is
wrong stops `sieve serve` with a named error."""

from __future__ import annotations

import hashlib
import threading
import time

import httpx
import pytest

from live_server import MODEL, start_server
from sieve.server.tenants import Tenants, TenantsError

BASE = {
    "tiers": {"premium": {"priority": 0, "share": 0.5}, "free": {"priority": 1}, "capped": {"priority": 1, "max_waiting": 1}},
    "tenants": {
        "acme": {"keys": ["sk-acme"], "tier": "premium"},
        "hashed": {"key_sha256": [hashlib.sha256(b"sk-secret").hexdigest()], "tier": "free"},
        "limited": {"keys": ["sk-limited"], "tier": "free", "requests_per_minute": 2},
        "tokens": {"keys": ["sk-tokens"], "tier": "free", "tokens_per_minute": 30},
        "single": {"keys": ["sk-single"], "tier": "free", "max_concurrent": 1},
        "share1": {"keys": ["sk-share1"], "share_prefix_cache": True},
        "share2": {"keys": ["sk-share2"], "share_prefix_cache": True},
        "capped": {"keys": ["sk-capped"], "tier": "capped"},
    },
}


@pytest.fixture(scope="module")
def tenant_server(llama_dir):
    from sieve import EngineConfig, LLMEngine

    tenants = Tenants.parse(BASE)
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=256, max_model_len=256,
                                    max_num_seqs=1, tier_shares=tenants.tier_shares()))  # (as sieve serve --tenants sets)
    url, stop = start_server(engine, api_key=None, tenants=tenants)
    yield url, engine, stop
    stop()


def post(url: str, key: str, **body) -> httpx.Response:
    body = {"prompt": "hello there", "max_tokens": 2, "temperature": 0, **body}
    return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body, timeout=60)


def until(condition, done: dict) -> None:
    """Wait for `condition` while the request that holds the one running slot ("hold" in `done` once over) runs."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline and "hold" not in done, "the long request ended before the others queued"
        time.sleep(0.005)


def test_keys_plain_and_as_sha256_and_a_wrong_key_is_401(tenant_server):
    import openai

    url = tenant_server[0]
    for key in ("sk-acme", "sk-secret"):  # (the file holds only the second one's hash)
        out = openai.OpenAI(base_url=url + "/v1", api_key=key).completions.create(model=MODEL, prompt="hi",
                                                                                  max_tokens=2)
        assert out.usage.completion_tokens == 2
    for key in ("sk-wrong", hashlib.sha256(b"sk-secret").hexdigest()):  # a hash is not a key
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key=key).completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_limits_answer_429_with_retry_after_and_leave_other_tenants_alone(tenant_server):
    url = tenant_server[0]
    assert [post(url, "sk-limited").status_code for _ in range(2)] == [200, 200]
    r = post(url, "sk-limited")
    assert r.status_code == 429 and r.json()["error"]["code"] == "requests_per_minute"
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert post(url, "sk-acme").status_code == 200  # another tenant: no limit of its own
    # tokens per minute: prompt tokens when admitted, generated ones when finished (here 2 requests pass 30 tokens)
    codes = [post(url, "sk-tokens", max_tokens=8).status_code for _ in range(4)]
    assert codes[0] == 200 and codes[-1] == 429, codes
    r = post(url, "sk-tokens")
    assert r.json()["error"]["code"] == "tokens_per_minute" and 1 <= int(r.headers["Retry-After"]) <= 60
    metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer sk-acme"}).text
    assert f'sieve:tenant_limit_refusals_total{{limit="requests_per_minute",model_name="{MODEL}",tenant="limited"}} 1.0' \
        in metrics
    assert 'tenant="acme"' in metrics and 'sieve:tenant_request_success_total{finished_reason="length"' in metrics


def test_max_concurrent_counts_a_stream_until_it_ends(tenant_server):
    url, _, stop = tenant_server
    aengine = stop.app.state.async_engine
    headers = {"Authorization": "Bearer sk-single"}
    body = {"prompt": "hello", "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True}
    aengine.step_delay = 0.05  # (40 tokens: 2 s in flight)
    try:
        with httpx.stream("POST", url + "/v1/completions", headers=headers, json=body, timeout=60) as stream:
            lines = stream.iter_lines()  # (one iterator: dropping one closes the connection)
            next(lines)  # in flight
            r = post(url, "sk-single")
            assert r.status_code == 429 and r.json()["error"]["code"] == "max_concurrent"
            assert "Retry-After" in r.headers
            assert [line for line in lines if line][-1] == "data: [DONE]"
    finally:
        aengine.step_delay = 0
    assert post(url, "sk-single").status_code == 200  # the stream's end released it


def test_a_higher_tier_is_served_first(tenant_server):
    """One running slot (max_num_seqs 1), held by a long request: a free tenant's request queued before a premium
    one's starts after it."""
    url, engine, stop = tenant_server
    aengine = stop.app.state.async_engine
    aengine.step_delay = 0.02
    done: dict[str, float] = {}

    def run(name, key, **body):
        r = post(url, key, **body)
        assert r.status_code == 200, r.text
        done[name] = time.monotonic()

    try:
        hold = threading.Thread(target=run, args=("hold", "sk-share1"), kwargs=dict(max_tokens=200, ignore_eos=True))
        hold.start()
        until(lambda: engine.scheduler.running, done)
        free = threading.Thread(target=run, args=("free", "sk-secret"))
        free.start()
        until(lambda: engine.num_waiting >= 1, done)
        premium = threading.Thread(target=run, args=("premium", "sk-acme"))
        premium.start()
        until(lambda: engine.num_waiting >= 2, done)
        for t in (hold, free, premium):
            t.join()
    finally:
        aengine.step_delay = 0
    assert done["hold"] < done["premium"] < done["free"]
    assert {"acme", "hashed", "share1"} <= set(engine.scheduler.tiers.served)  # each tenant's service counted


def test_a_tier_past_its_max_waiting_is_answered_429_and_other_tiers_still_queue(tenant_server):
    """One running slot, held by a long request: one request of the tier `capped` (max_waiting 1) waits, the next is
    refused with 429 queue_full naming the tier, with a Retry-After; a premium request still queues and is served,
    and so is the capped one that waited."""
    url, engine, stop = tenant_server
    aengine = stop.app.state.async_engine
    aengine.step_delay = 0.02
    codes: dict[str, int] = {}

    def run(name, key, **body):
        codes[name] = post(url, key, **body).status_code

    try:
        threads = [threading.Thread(target=run, args=("hold", "sk-share1"), kwargs=dict(max_tokens=200, ignore_eos=True))]
        threads[0].start()
        until(lambda: engine.scheduler.running, codes)
        threads.append(threading.Thread(target=run, args=("waits", "sk-capped")))
        threads[-1].start()
        until(lambda: engine.num_waiting_in("capped") == 1, codes)
        refused = post(url, "sk-capped")
        threads.append(threading.Thread(target=run, args=("premium", "sk-acme")))
        threads[-1].start()
        until(lambda: engine.num_waiting >= 2, codes)
        for t in threads:
            t.join()
    finally:
        aengine.step_delay = 0
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
    assert "the capped tier is at capacity (1 of its requests waiting)" in refused.json()["error"]["message"]
    assert int(refused.headers["Retry-After"]) >= 1
    assert codes == {"hold": 200, "waits": 200, "premium": 200}
    metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer sk-acme"}).text
    assert f'sieve:tenant_limit_refusals_total{{limit="max_waiting",model_name="{MODEL}",tenant="capped"}} 1.0' in metrics


def test_tenants_that_share_their_prefix_cache_hit_each_other_and_no_one_else(tenant_server):
    url, engine, _ = tenant_server
    prompt = "a long system prompt shared by two tenants, word after word, " * 6

    def hits(key):
        before = engine.block_manager.num_hit_tokens
        r = post(url, key, prompt=prompt)
        assert r.status_code == 200, r.text
        return engine.block_manager.num_hit_tokens - before, r.json()["usage"]["prompt_tokens_details"]

    assert hits("sk-share1")[0] == 0
    hit, details = hits("sk-share2")
    assert hit > 0 and details["cached_tokens"] == 0  # (a hit may be another tenant's: not reported)
    assert hits("sk-acme")[0] == 0  # a tenant that does not share is salted apart


@pytest.mark.parametrize("data, message", [
    ([], "expected an object with `tenants`"),
    ({"tenants": {"a": {"keys": ["k"]}}, "tierz": {}}, "unknown field 'tierz'"),
    ({"tenants": {"a": {"keys": ["k"], "tier": "gold"}}}, "tier 'gold' is not among tiers"),
    ({"tenants": {"a": {"keys": ["k"], "requests_per_min": 5}}}, "unknown field 'requests_per_min'"),
    ({"tenants": {"a": {"keys": ["k"], "max_concurrent": 0}}}, "tenants.a.max_concurrent: expected a whole number >= 1"),
    ({"tenants": {"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}}, "a key is given twice"),
    ({"tenants": {"a": {"keys": ["k"]}, "b": {"key_sha256": [hashlib.sha256(b"k").hexdigest()]}}}, "a key is given twice"),
    ({"tenants": {"a": {"key_sha256": ["abc"]}}}, "is not a sha256 hex digest"),
    ({"tiers": {"x": {"share": 0.6}, "y": {"share": 0.5}}, "tenants": {"a": {"keys": ["k"]}}}, "add up to more than 1"),
    ({"tiers": {"x": {"share": 2}}, "tenants": {"a": {"keys": ["k"]}}}, "tiers.x: expected"),
    ({"tiers": {"x": {"max_waiting": 0}}, "tenants": {"a": {"keys": ["k"]}}}, "tiers.x: expected"),
    ({"tiers": {"x": {"max_wait": 3}}, "tenants": {"a": {"keys": ["k"]}}}, "unknown field 'max_wait'"),
    ({"tenants": {"a": {"tier": "default"}}}, "tenants.a: no keys"),
    ({"tenants": {"a": {"keys": ["k"], "share_prefix_cache": "yes"}}}, "share_prefix_cache: expected true or false"),
])
def test_a_wrong_tenants_file_is_named(data, message):
    with pytest.raises(TenantsError, match=message.replace("(", r"\(").replace("[", r"\[")):
        Tenants.parse(data)


def test_sieve_serve_stops_on_a_tenants_file_that_does_not_parse(tmp_path, llama_dir):
    from test_cli import run_cli

    bad = tmp_path / "tenants.yaml"
    bad.write_text("tenants:\n  acme: {keys: [sk-1], tier: premium\n")
    r = run_cli("serve", "--model", str(llama_dir), "--tenants", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "tenants.yaml does not parse" in r.stderr
    bad.write_text("tenants:\n  acme: {keys: [sk-1], tier: premium}\n")
    r = run_cli("serve", "--model", str(llama_dir), "--tenants", str(bad))
    assert r.returncode == 2 and "tier 'premium' is not among tiers" in r.stderr
