"""OpenAI request bodies (pydantic) and their translation into `SamplingParams`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sieve.sampling_params import SamplingParams
from sieve.structured import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('`json_schema` is required with type "json_schema", and only with it')
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra field: exactly one of json, regex, choice, grammar (Lark or GBNF), json_object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=bool(self.json_object))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_queue: bool = False  # sieve's: an SSE comment with the expected wait first, and metrics.queue_ms last


class _Common(BaseModel):
    """A field the server does not know is refused (400 naming it), never dropped: `extra="forbid"`.
    Fields of OpenAI's API that sieve does not implement are declared, so that their no-op values
    (what some clients always send) pass and anything else is a 400 naming the field."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0)  # vLLM's (up to --max-logprobs): per prompt token, its logprob and the top-N
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's fields before v0.12 (it dropped them and now ignores them with a 200): honoured here, never ignored
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Prefill/decode disaggregation (vLLM's field): see sieve/distributed/kv_transfer.py
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: prefix-cache blocks are shared only among requests with the same salt
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # KV compression (sieve/kv_compression): {"press": "snapkv", "ratio": 0.5}, ratio the fraction of positions removed
    kv_compression: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server does not implement, or None."""
        return None

    def invalid(self) -> tuple[str, str] | None:
        return None

    def structured(self) -> StructuredOutputsParams | None:
        """The one output constraint the request asks for (ValueError when it asks for two)."""
        asked: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
            asked.append(("response_format", StructuredOutputsParams(json=schema)))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", self.structured_outputs.params()))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                asked.append((name, StructuredOutputsParams(**{kind: value})))
        if len(asked) > 1:
            raise ValueError(f"give one output constraint, not {' and '.join(n for n, _ in asked)}")
        return asked[0][1] if asked else None

    def token_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids (integers as strings)") from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logit_bias=self.token_bias(),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured(),
            kv_transfer_params=self.kv_transfer_params,
            cache_salt=self.cache_salt,
            kv_compression=self.kv_compression,
        )


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, p):
        if isinstance(p, list) and (not p or any(isinstance(x, list) and not x for x in p)):
            raise ValueError("a prompt must not be empty")
        return p

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, 1, self.n):
            return "best_of"
        return super().unsupported()

    def prompts(self) -> list[str | dict]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": p}]
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]


class ChatMessage(BaseModel):
    """A message; any other key is a 400 naming it ({"contnet": ...} once became an empty message). The keys OpenAI's
    own client sends back with an assistant message pass when empty."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    refusal: None = None
    annotations: list[Any] | None = Field(default=None, max_length=0)
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _text_parts_only(self) -> "ChatMessage":
        for i, part in enumerate(self.content if isinstance(self.content, list) else []):
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise ValueError(f"content[{i}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported: "
                                 f"this model reads text, and a {kind!r} part would be dropped")
        return self

    def template_dict(self) -> dict:
        """What the chat template sees: role, text, and the tool fields the message has."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            d["tool_calls"] = self.tool_calls
        for name in ("tool_call_id", "name"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated function calling: only its no-op values pass (use tools)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.functions:
            return "functions"
        if self.function_call not in (None, "none"):
            return "function_call"
        return None

    def invalid(self) -> tuple[str, str] | None:
        """(field, why) for the first rule of OpenAI's that the request breaks, or None."""
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            return "max_completion_tokens", f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}"
        return None

    @property
    def tool_mode(self) -> bool:
        """Tools are offered and may be called (the output is parsed for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    def structured(self) -> StructuredOutputsParams | None:
        from sieve.server.tools import check_tools, constraint

        if self.tools:  # checked even under tool_choice "none": a malformed tool is never passed over silently
            check_tools(self.tools, self.tool_choice)
        own = super().structured()
        forced = constraint(self.tools or [], self.tool_choice, self.parallel_tool_calls is not False) if self.tool_mode else None
        if self.tool_choice not in (None, "auto", "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if own is not None and forced is not None:
            raise ValueError("tool_choice \"required\" or a named function cannot be combined with another output constraint")
        return forced or own


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: `prompt`, or `messages` rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
