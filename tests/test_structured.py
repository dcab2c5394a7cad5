"""Structured outputs and tool calling on the real model (SmolLM2-135M-Instruct), through the `openai` client:
JSON schemas, regexes, choices and grammars hold; tool calls complete a round trip; streamed equals non-streamed
for a seed; grammar plus speculation equals grammar alone; what cannot be honoured is a 400 naming it."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

from live_server import API_KEY, SMOLLM2, metrics_page, start_server
from sieve import EngineConfig, LLMEngine, SamplingParams
from sieve.bench.structured import CITIES, PERSON  # a person: name, age, city, occupation, hobbies (bounded strings)
from sieve.server.tools import ToolCallParser, parse_tool_calls
from sieve.structured import StructuredOutputsParams

CITIES = CITIES[:20]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server[0]


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_twenty_json_schema_answers_parse_and_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def one(i):  # sampled answers can run long inside a string (one of these took 256+ tokens): room to finish
        return client.chat.completions.create(
            model=SMOLLM2, messages=ask(f"Describe a fictional person who lives in {CITIES[i]}, as JSON."),
            response_format=fmt, temperature=0.8, seed=i, max_tokens=512)

    with ThreadPoolExecutor(8) as pool:  # together: constrained rows share steps
        answers = list(pool.map(one, range(20)))
    for r in answers:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_and_the_completions_endpoint(client):
    r = client.chat.completions.create(model=SMOLLM2, messages=ask("Bob is 30 years old. Give his name and age as a JSON object."),
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=SMOLLM2, prompt="A user record in JSON:", max_tokens=200, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_regex_choice_and_grammar_hold(client):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    for seed in range(3):
        r = client.chat.completions.create(model=SMOLLM2, messages=ask("What is the phone number of the pizza place?"),
                                           temperature=1.0, seed=seed, max_tokens=30, extra_body={"structured_outputs": {"regex": phone}})
        assert re.fullmatch(phone, r.choices[0].message.content), r.choices[0].message.content
        r = client.completions.create(model=SMOLLM2, prompt="Review: 'I loved it!' Sentiment:", temperature=1.0, seed=seed,
                                      max_tokens=10, extra_body={"structured_outputs": {"choice": ["positive", "negative", "neutral"]}})
        assert r.choices[0].text in ("positive", "negative", "neutral") and r.choices[0].finish_reason == "stop"
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,2}/\n'
    r = client.chat.completions.create(model=SMOLLM2, messages=ask("What is 6 times 7?"), temperature=0, max_tokens=20,
                                       extra_body={"structured_outputs": {"grammar": lark}})
    assert re.fullmatch(r"The answer is [1-9][0-9]{0,2}\.", r.choices[0].message.content)
    # vLLM's pre-0.12 field (vLLM now ignores it with a 200): honoured here
    r = client.chat.completions.create(model=SMOLLM2, messages=ask("Pick a colour."), temperature=0, max_tokens=10,
                                       extra_body={"guided_choice": ["red", "green", "blue"]})
    assert r.choices[0].message.content in ("red", "green", "blue")


def test_streamed_equals_non_streamed_for_a_seed(client):
    for body in (
        dict(messages=ask("Describe a chef from Lyon as JSON."), response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}),
        dict(messages=ask("What is the weather in Oslo?"), tools=[WEATHER, TIME], tool_choice="required"),
    ):
        whole = client.chat.completions.create(model=SMOLLM2, temperature=0.9, seed=1234, max_tokens=200, **body).choices[0]
        content, calls, reason = "", {}, None
        for chunk in client.chat.completions.create(model=SMOLLM2, temperature=0.9, seed=1234, max_tokens=200, stream=True, **body):
            d = chunk.choices[0].delta
            content += d.content or ""
            for c in d.tool_calls or []:
                slot = calls.setdefault(c.index, {"name": "", "arguments": ""})
                slot["name"] += c.function.name or ""
                slot["arguments"] += c.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        assert (content or None) == whole.message.content and reason == whole.finish_reason
        want = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls or []]
        assert [calls[i] for i in sorted(calls)] == want


def test_tool_call_round_trip(client):
    messages = [{"role": "system", "content": "You are a helpful assistant with tools."}, *ask("What's the weather like in Paris?")]
    r = client.chat.completions.create(model=SMOLLM2, messages=messages, tools=[WEATHER, TIME], tool_choice="required",
                                       temperature=0, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    # the result goes back as a `tool` message; the model answers in words (tools offered, none forced)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "unit": "celsius", "sky": "sunny"})}]
    r = client.chat.completions.create(model=SMOLLM2, messages=messages, tools=[WEATHER, TIME], temperature=0, max_tokens=60)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    # a named function: that one, its arguments valid
    r = client.chat.completions.create(model=SMOLLM2, messages=ask("Weather in Tokyo, in fahrenheit?"), tools=[WEATHER, TIME],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=80)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_the_template_sees_tools_and_tool_messages(server):
    """SmolLM2's template knows no tools: they go in the system message, an assistant's calls are written in the
    Hermes format, and a `tool` message renders through the template under its own role."""
    import httpx

    messages = [*ask("Weather in Rome?"),
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = httpx.post(server + "/tokenize", headers={"Authorization": f"Bearer {API_KEY}"}, json={"messages": messages, "return_token_strs": False})
    assert r.status_code == 200
    text = httpx.post(server + "/detokenize", headers={"Authorization": f"Bearer {API_KEY}"}, json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n21 C<|im_end|>" in text


@pytest.mark.parametrize("body, param, message", [
    ({"structured_outputs": {"regex": "a(b"}}, "response_format", "regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}}}},
     "response_format", "if"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, None, "not response_format and structured_outputs"),
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, None, "exactly one"),
    ({"structured_outputs": {"json": {}, "disable_fallback": True}}, "structured_outputs.disable_fallback", "unknown field"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "response_format", "grammar"),
    ({"structured_outputs": {"choice": ["a"]}, "min_tokens": 2}, None, "min_tokens"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "nope"),
    ({"tool_choice": "required"}, None, "tool_choice needs tools"),
    ({"tools": [{"type": "function", "function": {}}]}, None, "tools[0]"),
    ({"tools": [{"type": "function"}], "tool_choice": "none"}, None, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, None, "cannot be combined"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(server, body, param, message):
    import httpx

    r = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": SMOLLM2, "messages": ask("hi"), "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    if message is not None:
        assert message in err["message"], err["message"]


def test_mask_time_is_on_metrics(server, client):
    client.chat.completions.create(model=SMOLLM2, messages=ask("JSON please"), response_format={"type": "json_object"},
                                   temperature=0, max_tokens=20)
    page = metrics_page(server)
    value = {line.split(" ")[0].split("{")[0]: float(line.split(" ")[1]) for line in page.splitlines()
             if line.startswith("sieve:structured_output")}
    assert value["sieve:structured_output_mask_seconds_total"] > 0
    assert value["sieve:structured_output_mask_steps_total"] > 0 and value["sieve:structured_output_mask_rows_total"] > 0
    assert value["sieve:structured_output_grammars_compiled_total"] > 0


def test_a_grammar_that_does_not_compile_in_time_is_a_400(llama_engine_factory):
    """--structured-outputs-compile-timeout bounds compilation (0 s: no compile ever finishes in time); the
    engine is never asked."""
    import httpx

    eng = llama_engine_factory().llm_engine
    url, stop = start_server(eng, grammar_timeout=0.0)
    try:
        r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "[a-z]{3,9}"}})
        assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_timeout"
    finally:
        stop()
    assert eng.num_steps == 0


def _grounded_json_prompts(tok, n):
    records = [{"name": f"Ada {c}", "age": 20 + i, "city": c, "occupation": "pilot", "hobbies": ["chess", "rowing"][: 1 + i % 2]} for i, c in enumerate(CITIES[:n])]
    return [{"prompt_token_ids": tok.apply_chat_template(
        ask(f"Here is a record: {json.dumps(r)}\nRepeat it exactly as JSON."), add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"]} for r in records]


def test_grammar_with_speculation_equals_grammar_alone():
    """Constrained drafts are verified under the mask of the position each one takes (and cut at the first token
    the grammar forbids); the output is the same, greedy and seeded, with drafts really accepted."""
    from sieve.models.default import default_model_path

    config = dict(model=str(default_model_path()), kv_cache_memory_gb=0.5, max_model_len=2048)
    engine = LLMEngine(EngineConfig(**config))  # (the module's engine belongs to its server's thread)
    spec = LLMEngine(EngineConfig(**config, speculative_config={"method": "ngram", "num_speculative_tokens": 4}))
    prompts = _grounded_json_prompts(engine.tokenizer, 6)
    so = StructuredOutputsParams(json=PERSON)
    for params in (SamplingParams(temperature=0, max_tokens=120, structured_outputs=so),
                   SamplingParams(temperature=0.8, seed=5, max_tokens=120, structured_outputs=so)):
        outs = {}
        for name, eng in (("plain", engine), ("spec", spec)):
            for i, p in enumerate(prompts):
                eng.add_request(f"{name}-{params.temperature}-{i}", p, params)
            got = {}
            while eng.has_unfinished():
                for o in eng.step():
                    if o.finished:
                        got[o.request_id.rsplit("-", 1)[1]] = o.outputs[0].token_ids
            outs[name] = got
        assert outs["spec"] == outs["plain"]
    assert spec.speculator.stats.num_accepted_tokens > 20
    for toks in outs["plain"].values():
        jsonschema.validate(json.loads(engine.tokenizer.decode(toks, skip_special_tokens=True)), PERSON)


def test_tool_call_parser_streams_like_it_parses():
    text = ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n')
    content, calls = parse_tool_calls(text)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    for step in (1, 2, 5, 11):
        p, got, n = ToolCallParser(), "", 0
        for i in range(0, len(text), step):
            c, new = p.feed(text[i:i + step])
            got, n = got + c, n + len(new)
        got += p.finish()
        assert (got, n) == (content, 2)
    # a malformed call is content, never dropped
    assert parse_tool_calls("x <tool_call>{oops</tool_call> y") == ("x <tool_call>{oops</tool_call> y", [])


@pytest.mark.parametrize("vocab", [49152, 1000, 77])
def test_native_token_bitmask_equals_the_pytorch_path(vocab, monkeypatch):
    """The CPU kernel that applies grammar masks gives what the PyTorch path (CUDA's) gives: random words, all-0
    and all-1 words, a vocabulary that is not a multiple of 32, logits wider than the mask, a subset of rows."""
    import sieve.kernels
    from sieve.structured import apply_bitmask

    assert sieve.kernels.cpu_ops() is not None
    g = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    mask = torch.randint(-2**31, 2**31 - 1, (6, words), dtype=torch.int32, generator=g)
    mask[1], mask[2] = -1, 0
    logits = torch.randn(6, 32 * words + 3, generator=g)
    for rows in ([0, 1, 2, 3, 4, 5], [1, 4, 5], [2]):
        native, ref = logits.clone(), logits.clone()
        apply_bitmask(native, mask, rows)
        monkeypatch.setattr(sieve.kernels, "cpu_ops", lambda: None)
        apply_bitmask(ref, mask, rows)
        monkeypatch.undo()
        assert torch.equal(native, ref)
        untouched = [r for r in range(6) if r not in rows]
        assert torch.equal(native[untouched], logits[untouched])
        assert torch.isneginf(native[rows, 32 * words:]).all()  # past the mask's words: never allowed


def test_generate_cli_takes_llama_cpp_constraint_flags(tmp_path):
    """`sieve generate --choice/--regex/--json-schema @file/--grammar`, and a bad one is one error line, exit 2 (before
    the model loads where the model is not needed to tell)."""
    from test_cli import run_cli

    r = run_cli("generate", "--prompt", "Is the sky blue? Answer yes or no.", "--chat", "--temperature", "0",
                "--choice", "yes", "--choice", "no")
    assert r.returncode == 0 and r.stdout.strip() in ("yes", "no"), r.stderr[-500:]
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                                  "additionalProperties": False}))
    r = run_cli("generate", "--prompt", "Give a number as JSON.", "--chat", "--temperature", "0", "--max-tokens", "20",
                "--json-schema", f"@{schema}")
    assert r.returncode == 0 and isinstance(json.loads(r.stdout)["n"], int), r.stdout
    r = run_cli("generate", "--prompt", "x", "--regex", "a(b")
    assert r.returncode == 2 and "regex" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("generate", "--prompt", "x", "--regex", "a", "--choice", "a")
    assert r.returncode == 2 and "exactly one" in r.stderr
    # What needs no model is refused before it loads (a regex's syntax needs its vocabulary, so it waits for it)
    r2 = run_cli("generate", "--prompt", "x", "--json-schema", f"@{tmp_path / 'missing.json'}")
    assert r2.returncode == 2 and "missing.json" in r2.stderr and "Traceback" not in r2.stderr
    assert "loaded" not in r.stderr + r2.stderr, r.stderr
