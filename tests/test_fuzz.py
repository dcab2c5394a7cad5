"""Schemathesis against the server's own OpenAPI document on a live server: generated requests (valid and
invalid) to every route must never get a 5xx, and every answer must be a status, content type and body
the document declares."""

from __future__ import annotations

import collections
import itertools

import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

from live_server import API_KEY, start_server, wait_idle

EXAMPLES = 30

@pytest.fixture(scope="module")
def live(llama_dir, tmp_path_factory):
    from sieve import EngineConfig, LLMEngine

    # small limits so that generated requests stay cheap: 64-token context, at most 4 choices and 4 prompts
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=64))
    url, stop = start_server(engine, max_n=4, max_prompts=4, max_waiting=64, max_body_bytes=1 << 16,
                             batch_dir=str(tmp_path_factory.mktemp("fuzz-batches")))
    yield url, engine
    stop()


def test_generated_requests_get_documented_answers(live):
    """Each operation of the document gets up to `EXAMPLES` generated requests (hypothesis, derandomized: the same
    cases every run), each POST as many more with invalid bodies; every answer passes schemathesis's checks."""
    url, engine = live
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    tally: collections.Counter = collections.Counter()
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {o.path for o in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/messages",
                                             "/v1/messages/count_tokens", "/v1/responses", "/v1/responses/{response_id}",
                                             "/v1/models", "/tokenize", "/detokenize",
                                             "/health", "/metrics"}
    for operation, mode in itertools.product(operations, list(GenerationMode)):  # valid bodies, and invalid ones
        if mode is GenerationMode.NEGATIVE and (operation.method.upper() != "POST" or not operation.body.items):
            continue  # (nothing to make invalid: a POST without a body, its one path parameter any string)

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
        def run(case):
            response = case.call(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
            tally["cases"] += 1
            tally[response.status_code] += 1
            case.validate_response(response, checks=checks)

        run()
    print(f"schemathesis: {tally['cases']} cases over {len(operations)} operations; statuses {dict(sorted((k, v) for k, v in tally.items() if k != 'cases'))}")
    assert tally["cases"] >= EXAMPLES * 8 and not [s for s in tally if isinstance(s, int) and s >= 500]
    assert tally[200] > 0 and tally[400] > 0  # both accepted and refused requests were generated
    wait_idle(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_document_lists_every_error_status(llama_dir):
    from sieve import EngineConfig, LLMEngine
    from sieve.server.app import create_app

    app = create_app(LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=16, max_model_len=64)),
                     api_key="k")
    doc = app.openapi()
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "405", "413", "429", "500", "503"} <= set(completions) and "422" not in completions
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "503" in doc["paths"]["/health"]["get"]["responses"]
    assert all("422" not in op["responses"] for ops in doc["paths"].values() for op in ops.values())
    app.state.async_engine.stop()


def test_hostile_clients_against_a_disaggregated_pair_behind_the_gateway(llama_dir, tmp_path):
    """A bounded barrage of what hostile clients send (forged and replayed kv_transfer_params, thousands of stop
    strings, vocabulary-sized logit_bias, misspelt and unsupported fields, empty prompts, oversized and broken bodies,
    wrong keys, streams abandoned unread, requests the decode leg refuses), eight at a time, to a prefill + decode pair
    (the shared secret, the decode server listing its producer) behind a keyed gateway, and straight to the decode
    server. None may get a 5xx or hang; afterwards no KV block is held by a request and the prefill's export store
    holds nothing."""
    import asyncio
    import os
    import random

    import httpx

    from live_server import serve_app
    from sieve import EngineConfig, LLMEngine
    from sieve.router.app import create_router_app
    from sieve.router.config import parse_config

    secret = tmp_path / "kv.key"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)

    def engine(**kw):
        return LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=128, max_model_len=128,
                                      block_size=4, **kw))

    prefill = engine(kv_role="prefill", kv_transfer_config={"secret_file": str(secret), "lease_s": 30})
    producer = f"127.0.0.1:{prefill.kv_connector.store.port}"
    decode = engine(kv_role="decode", kv_transfer_config={"secret_file": str(secret), "producers": [producer],
                                                          "transfer_timeout_s": 2})
    (p_url, p_stop), (d_url, d_stop) = start_server(prefill), start_server(decode, max_body_bytes=1 << 20)
    cfg = parse_config({"backends": [{"name": "pd", "url": d_url + "/v1", "model": "tiny-llama", "api_key": API_KEY,
                                      "prefill": [p_url + "/v1"]}], "cache": {"backend": "none"}, "api_keys": {"gw-key": "t1"},
                        "max_body_bytes": 1 << 20})
    g_url, g_stop = serve_app(create_router_app(cfg))
    rng = random.Random(0)
    vocab = decode.arch.vocab_size

    def case(i: int) -> tuple[str, str, dict | bytes, dict, bool]:
        """(base url, path, body, headers, stream it but stop reading)"""
        kind = i % 14
        text = " ".join(str(rng.randrange(1000)) for _ in range(rng.randint(3, 30)))
        chat = {"model": "pd", "messages": [{"role": "user", "content": text}], "max_tokens": rng.randint(1, 12)}
        forged = {"do_remote_prefill": True, "transport": rng.choice(["tcp", "shm"]), "remote_host": "127.0.0.1",
                  "remote_port": rng.choice([1, 9, 2**70, -1, "x"]), "remote_shm_dir": rng.choice(["/tmp", "/dev/shm", "../"]),
                  "remote_block_hashes": [rng.choice(["0" * 32, "../../etc/passwd", 7])] * rng.randint(0, 5000),
                  "kv_signature": rng.choice([None, "00" * 32, 5])}
        gw, direct = (g_url, {"Authorization": "Bearer gw-key"}), (d_url, {"Authorization": f"Bearer {API_KEY}"})
        if kind == 0:
            return (*direct[:1], "/v1/chat/completions", {**chat, "model": None, "kv_transfer_params": forged}, direct[1], False)
        if kind == 1:
            return (*gw[:1], "/v1/chat/completions", {**chat, "kv_transfer_params": forged}, gw[1], False)
        if kind == 2:
            return (*gw[:1], "/v1/chat/completions", {**chat, "stop": [f"s{j}" for j in range(2000)]}, gw[1], False)
        if kind == 3:
            return (*direct[:1], "/v1/completions", {"prompt": text, "logit_bias": {str(t): 1 for t in range(vocab)}}, direct[1], False)
        if kind == 4:
            return (*gw[:1], "/v1/chat/completions", {**chat, "messages": [{"role": "user", "contnet": text}]}, gw[1], False)
        if kind == 5:
            return (*direct[:1], "/v1/completions", {"prompt": rng.choice([[], [[]], "", [[1, 2], []]])}, direct[1], False)
        if kind == 6:
            return (*gw[:1], "/v1/chat/completions", {**chat, "max_tokens": 100_000}, gw[1], False)  # the decode leg refuses
        if kind == 7:
            return (*gw[:1], "/v1/chat/completions", bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))), gw[1], False)
        if kind == 8:
            return (*gw[:1], "/v1/chat/completions", {**chat, "messages": "x" * (2 << 20)}, gw[1], False)
        if kind == 9:
            return (*gw[:1], "/v1/chat/completions", chat, {"Authorization": "Bearer " + "k" * rng.randint(1, 40)}, False)
        if kind == 10:
            return (*gw[:1], "/v1/chat/completions", {**chat, "stream": True, "max_tokens": 40, "ignore_eos": True}, gw[1], True)
        if kind == 11:
            return (*direct[:1], "/v1/chat/completions", {**chat, "model": None, "top_logprobs": 3, "stream_options": {"x": 1}},
                    direct[1], False)
        if kind == 12:
            return (*gw[:1], "/v1/completions", {"model": "pd", "prompt": text, "max_tokens": "7"}, gw[1], False)
        return (*gw[:1], "/v1/chat/completions", chat, gw[1], False)  # an ordinary request among them

    cases = [case(i) for i in range(280)]
    tally: collections.Counter = collections.Counter()

    async def one(http, base, path, body, headers, abandon):
        try:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            if abandon:
                async with http.stream("POST", base + path, headers=headers, **kw) as r:
                    tally[r.status_code] += 1
                    async for _ in r.aiter_lines():
                        break  # one line, then the client goes away
                return
            r = await http.post(base + path, headers=headers, **kw)
            tally[r.status_code] += 1
            if r.status_code >= 400:
                assert "error" in r.json(), r.text[:200]
        except httpx.TimeoutException:
            tally["hung"] += 1

    async def main():
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as http:
            async def guarded(c):
                async with sem:
                    await one(http, *c)
            await asyncio.gather(*(guarded(c) for c in cases))

    try:
        asyncio.run(main())
        for e in (prefill, decode):
            wait_idle(e, timeout=30)
        leaked = sum(e.block_manager.num_blocks - e.block_manager.num_free_blocks for e in (prefill, decode))
        held = prefill.kv_connector.store.bytes_held
        errors = sum(n for s, n in tally.items() if isinstance(s, int) and s >= 500)
        print(f"hostile clients: {len(cases)} cases; statuses {dict(sorted((k, v) for k, v in tally.items() if k != 'hung'))}; "
              f"{errors} 5xx, {tally['hung']} hung, {leaked} blocks held by requests, {held} bytes held by the export store")
        assert errors == 0 and tally["hung"] == 0 and tally[200] > 0 and tally[400] > 0 and tally[401] > 0
        assert not decode.requests and not prefill.requests and leaked == 0 and held == 0
        refused = decode.kv_connector.stats.refused
        assert sum(refused.values()) >= 20 and decode.kv_connector.stats.blocks["load"] > 0  # forged refused, real loaded
    finally:
        g_stop()
        p_stop()
        d_stop()
