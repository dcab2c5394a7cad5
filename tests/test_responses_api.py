"""OpenAI's Responses API (/v1/responses) driven by the `openai` client on a live server: the same tokens as the
chat completion it translates to, multi-turn through previous_response_id, the store (store false, GET, DELETE,
bounded), typed stream events, background responses and cancel, tools and text.format on the real model, and
what cannot be honoured as a 400 naming it."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from live_server import API_KEY, MODEL, SMOLLM2, start_server, wait_idle

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0)


def chat_text(client, messages, max_tokens):
    c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return c.choices[0].message.content, c.usage.prompt_tokens


def test_a_response_is_the_chat_completion_it_stands_for_and_turns_continue(client):
    r = client.responses.create(model=MODEL, input="hello there", instructions="be brief", max_output_tokens=12, temperature=0)
    text, prompt_tokens = chat_text(client, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}], 12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == text and r.usage.input_tokens == prompt_tokens and r.usage.output_tokens == 12
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # (a random model rarely ends)
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    # the next turn sees the earlier one, not its instructions (as OpenAI's)
    r2 = client.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "and then?"}]}],
                                 previous_response_id=r.id, max_output_tokens=8, temperature=0)
    text2, prompt2 = chat_text(client, [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": text},
                                        {"role": "user", "content": "and then?"}], 8)
    assert r2.output_text == text2 and r2.usage.input_tokens == prompt2 and r2.previous_response_id == r.id
    got = client.responses.retrieve(r2.id)
    assert got.output_text == r2.output_text and got.status == r2.status
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=r.id, max_output_tokens=2)
    unstored = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_streamed_events_build_the_same_response(client):
    kw = dict(model=MODEL, input="count with me", max_output_tokens=16, temperature=0.8, extra_body={"seed": 5})
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    final = events[-1].response
    assert final.output[0].content[0].text == whole.output_text and final.usage.output_tokens == 16
    assert client.responses.retrieve(final.id).output[0].content[0].text == whole.output_text  # stored when it ended


def test_background_responses_run_on_and_can_be_cancelled(server, client):
    url, engine = server
    r = client.responses.create(model=MODEL, input="hello", max_output_tokens=12, temperature=0, background=True)
    assert r.status in ("queued", "in_progress") and r.background
    deadline = time.time() + 30
    while client.responses.retrieve(r.id).status in ("queued", "in_progress") and time.time() < deadline:
        time.sleep(0.05)
    done = client.responses.retrieve(r.id)
    sync = client.responses.create(model=MODEL, input="hello", max_output_tokens=12, temperature=0)
    assert done.status == "incomplete" and done.output_text == sync.output_text
    long = client.responses.create(model=MODEL, input="hello", max_output_tokens=400, temperature=0, background=True)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    wait_idle(engine)
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    with pytest.raises(openai.BadRequestError, match="only background responses"):
        client.responses.cancel(sync.id)


@pytest.mark.parametrize("extra, param, message", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, None, "input_image"),
    ({"include": ["message.output_text.logprobs"]}, "include", None),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", None),
    ({"tool_choice": "required"}, None, "tool_choice needs tools"),
    ({"background": True, "store": False}, None, "background needs store"),
    ({"input": [{"type": "reasoning", "id": "r"}]}, None, "'reasoning' item"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({"top_logprobs": 2}, "top_logprobs", "unknown field"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(server, extra, param, message):
    r = httpx.post(server[0] + "/v1/responses", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and (message is None or message in r.json()["error"]["message"])


def test_a_tenants_responses_are_its_own_and_the_store_is_bounded(llama_dir):
    from sieve import EngineConfig, LLMEngine
    from sieve.server.auth import APIKeys

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=256))
    url, stop = start_server(engine, api_key=APIKeys({"key-a": "a", "key-b": "b"}), max_stored_responses=2)
    try:
        a, b = (openai.OpenAI(base_url=url + "/v1", api_key=k, max_retries=0) for k in ("key-a", "key-b"))
        first = a.responses.create(model=MODEL, input="one", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=2)
        for text in ("two", "three"):
            a.responses.create(model=MODEL, input=text, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):  # the oldest of three, past --max-stored-responses 2
            a.responses.retrieve(first.id)
    finally:
        stop()


@pytest.fixture(scope="module")
def smollm2(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server[0] + "/v1", api_key=API_KEY, max_retries=0)


def test_function_calls_and_text_format_on_the_real_model(smollm2):
    """A required function is called (its arguments held to the schema) as a function_call item, streamed or not; its
    output goes back as a function_call_output item on the next turn and the model answers in words; a JSON schema
    through text.format completes, and the stream helper parses it."""
    kw = dict(model=SMOLLM2, input="What's the weather like in Paris, in celsius?", tools=[WEATHER], tool_choice="required",
              max_output_tokens=80, temperature=0)
    r = smollm2.responses.create(**kw)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    with smollm2.responses.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    assert [i.arguments for i in final.output if i.type == "function_call"] == [c.arguments for c in calls]
    answer = smollm2.responses.create(model=SMOLLM2, previous_response_id=r.id, tools=[WEATHER], temperature=0,
                                      max_output_tokens=40, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                                    "output": json.dumps({"temperature": 18, "sky": "sunny"})}])
    assert answer.output_text.strip() and answer.output[0].type == "message"
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": schema}}
    with smollm2.responses.stream(model=SMOLLM2, input="Name a city.", text=fmt, max_output_tokens=40, temperature=0) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.text.format.type == "json_schema"
    jsonschema.validate(json.loads(final.output_text), schema)
