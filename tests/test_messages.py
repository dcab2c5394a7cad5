"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) driven by the `anthropic` client on a live
server: the same tokens as the chat completion it translates to, streamed as Anthropic's events, stop sequences and
token limits named as Anthropic names them, tools as tool_use and tool_result blocks (on the real model), errors in
Anthropic's shape; and the offline `LLM.chat`."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from live_server import API_KEY, MODEL, SMOLLM2

GREEDY = {"temperature": 0}  # (the newest client no longer takes temperature as an argument: sent as a body field)
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                                                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server[0], api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY)


def test_a_message_is_the_chat_completion_it_stands_for(client, oai):
    """System prompt, turns and stop sequences: the same greedy tokens as /v1/chat/completions, usage the same counts."""
    turns = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"},
             {"role": "user", "content": [{"type": "text", "text": "tell me "}, {"type": "text", "text": "more"}]}]
    m = client.messages.create(model=MODEL, max_tokens=16, system="be brief", messages=turns, extra_body=GREEDY)
    chat = [{"role": "system", "content": "be brief"}, turns[0], turns[1], {"role": "user", "content": "tell me more"}]
    c = oai.chat.completions.create(model=MODEL, max_tokens=16, messages=chat, temperature=0)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == c.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 16 == c.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert client.messages.count_tokens(model=MODEL, system="be brief", messages=turns).input_tokens == c.usage.prompt_tokens
    # a stop sequence taken from the greedy text itself (where it first occurs) ends it there, and is named
    text = m.content[0].text
    at = next(k for k in range(4, len(text) - 3) if text.find(text[k:k + 3]) == k and text[k:k + 3].strip())
    stop = text[at:at + 3]
    s = client.messages.create(model=MODEL, max_tokens=16, system="be brief", messages=turns, stop_sequences=[stop],
                               extra_body=GREEDY)
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == stop and s.content[0].text == text[:at]


def test_streamed_message_equals_the_whole_one(client):
    kw = dict(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "count with me"}],
              extra_body={"temperature": 0.8, "seed": 7})
    whole = client.messages.create(**kw)
    types, deltas = [], []
    with client.messages.stream(**kw) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "content_block_delta":
                deltas.append(event.delta.text)
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop" and "message_delta" in types
    assert types.count("content_block_start") == types.count("content_block_stop") == 1
    assert "".join(deltas) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens == 20


def test_the_key_comes_as_x_api_key_or_bearer(server):
    url = server[0]
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}).status_code == 200
    assert httpx.post(url + "/v1/messages", json=body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(**body)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "invalid or missing API key"}}


@pytest.mark.parametrize("extra, message", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]}, "image"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"output_config": {"effort": "high"}}, "effort"),
    ({"top_logprobs": 3}, "unknown field `top_logprobs`"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "from the assistant"),
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "name"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "nope"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
])
def test_what_cannot_be_honoured_is_a_400_in_anthropics_shape(server, extra, message):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(server[0] + "/v1/messages", json=body, headers={"x-api-key": API_KEY})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert message in r.json()["error"]["message"]


def test_an_unknown_model_is_anthropics_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-nope" in e.value.body["error"]["message"]


def test_offline_chat_is_generate_on_the_template(llama_llm):
    from sieve import SamplingParams

    conversations = [[{"role": "user", "content": "hello"}],
                     [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what now?"}]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tok = llama_llm.get_tokenizer()
    chats = llama_llm.chat(conversations, params)
    for conversation, out in zip(conversations, chats):
        text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert out.prompt == text and out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
        assert out.outputs[0].token_ids == llama_llm.generate({"prompt_token_ids": out.prompt_token_ids}, params)[0].outputs[0].token_ids
    assert llama_llm.chat(conversations[0], params)[0].outputs[0].text == chats[0].outputs[0].text  # one conversation


@pytest.fixture(scope="module")
def smollm2(smollm2_server):
    return anthropic.Anthropic(base_url=smollm2_server[0], api_key=API_KEY, max_retries=0)


def test_tool_use_round_trip_on_the_real_model(smollm2):
    """A named tool is called (the grammar holds its input to the schema) as a tool_use block, streamed or not; its
    result goes back as a tool_result block and the model answers in words; JSON output through output_config."""
    ask = [{"role": "user", "content": "What's the weather like in Paris, in celsius?"}]
    kw = dict(model=SMOLLM2, max_tokens=80, messages=ask, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
              extra_body=GREEDY)
    m = smollm2.messages.create(**kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content][-1] == "tool_use"
    call = m.content[-1]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with smollm2.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use" and final.content[-1].input == call.input
    turns = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                 "content": json.dumps({"temperature": 18, "sky": "sunny"})}]}]
    answer = smollm2.messages.create(model=SMOLLM2, max_tokens=40, messages=turns, tools=[WEATHER], extra_body=GREEDY)
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text.strip()
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert smollm2.messages.count_tokens(model=SMOLLM2, messages=turns, tools=[WEATHER]).input_tokens == \
        answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    j = smollm2.messages.create(model=SMOLLM2, max_tokens=40, messages=[{"role": "user", "content": "Name a city."}],
                                output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY)
    jsonschema.validate(json.loads(j.content[0].text), schema)


def test_a_failed_step_reaches_messages_responses_and_embeddings_clients(llama_dir):
    """Fault injection: the engine's step raises mid-stream. Anthropic's stream ends with an `error` event (the client
    raises it), the Responses API's with an `error` event; a whole message, response or embedding request gets a 500
    in its API's shape; serving goes on and no block is left behind."""
    from live_server import faulty_engine, start_server, wait_idle

    engine, state = faulty_engine(llama_dir)
    url, stop = start_server(engine)
    try:
        a = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=30)
        o = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
        msg = dict(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "hi"}])
        state["fail_at"] = state["calls"] + 4
        with pytest.raises(anthropic.APIStatusError, match="injected fault"):
            with a.messages.stream(**msg) as stream:
                for _ in stream:
                    pass
        state["fail_at"] = state["calls"] + 4
        with o.responses.stream(model=MODEL, input="hi", max_output_tokens=50) as stream:
            kinds = [e.type for e in stream]
        assert kinds[-1] == "error" and "response.output_text.delta" in kinds
        for path, body in (("/v1/messages", msg), ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 50}),
                           ("/v1/embeddings", {"model": MODEL, "input": "hi"})):
            state["fail_at"] = state["calls"] + 1
            r = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
            assert r.status_code == 500 and "injected fault" in r.text, (path, r.text)
            assert (r.json()["error"]["type"] == "api_error") if path == "/v1/messages" else (r.json()["error"]["type"] == "server_error")
        assert a.messages.create(**msg).usage.output_tokens >= 1  # serving goes on
        wait_idle(engine)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        stop()
