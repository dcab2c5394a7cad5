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
def live(llama_dir):
    from sieve import EngineConfig, LLMEngine

    # small limits so that generated requests stay cheap: 64-token context, at most 4 choices and 4 prompts
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=64))
    url, stop = start_server(engine, max_n=4, max_prompts=4, max_waiting=64, max_body_bytes=1 << 16)
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
    assert {o.path for o in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
                                             "/health", "/metrics"}
    for operation, mode in itertools.product(operations, list(GenerationMode)):  # valid bodies, and invalid ones
        if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue

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
