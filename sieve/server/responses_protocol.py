"""OpenAI's Responses API request body (pydantic), translated into the chat request the server already serves:
`instructions`, input items (messages, function calls and their outputs), function tools, `text.format`.

Every field the API defines that a client may send is declared; the ones sieve does not implement pass only with their
no-op values, and anything else is a 400 naming the field. Image and file inputs are a 400: this model reads text."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sieve.server.protocol import ChatCompletionRequest, ChatMessage

TEXT_PARTS = ("input_text", "output_text")


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # a called function's arguments always follow its schema here

    def chat(self) -> dict:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters or {"type": "object"}}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError('`schema` is required with type "json_schema", and only with it')
        return self

    def response_format(self) -> dict | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": self.name or "output", "schema": self.schema_}}


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: None = None


class Reasoning(BaseModel):
    """For models that reason: only its no-op value passes."""

    model_config = ConfigDict(extra="forbid")
    effort: None = None
    summary: None = None


def item_messages(item: Any, where: str) -> list[dict]:
    """One input item as chat messages (a ValueError naming what cannot be read)."""
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        extra = sorted(set(item) - {"type", "role", "content", "id", "status"})
        if extra:
            raise ValueError(f"{where}.{extra[0]}: unknown field of a message item")
        if item.get("role") not in ("user", "system", "developer", "assistant"):
            raise ValueError(f"{where}.role must be user, system, developer or assistant")
        return [{"role": item["role"], "content": content_text(item.get("content"), f"{where}.content")}]
    if kind == "function_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise ValueError(f"{where}: a function_call item needs string call_id, name and arguments")
        call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise ValueError(f"{where}: a function_call_output item needs a string call_id")
        return [{"role": "tool", "tool_call_id": item["call_id"], "content": content_text(item.get("output"), f"{where}.output")}]
    raise ValueError(f"{where}: a {kind!r} item is not supported: this server reads message, function_call and "
                     "function_call_output items")


def content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text parts")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{i}]: only text parts (input_text, output_text) are supported: this model reads "
                             f"text, and a {kind!r} part would be dropped")
        texts.append(part["text"])
    return "".join(texts)


def merge_calls(messages: list[dict]) -> list[dict]:
    """Function calls that follow an assistant message (or each other) join it, as one turn with several calls."""
    out: list[dict] = []
    for m in messages:
        prev = out[-1] if out else None
        if m.get("tool_calls") and m.get("content") is None and prev is not None and prev["role"] == "assistant":
            out[-1] = {**prev, "tool_calls": [*(prev.get("tool_calls") or []), *m["tool_calls"]]}
        else:
            out.append(m)
    return out


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # sieve's, as on its other routes
    stream: bool = False
    store: bool = True
    background: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a hint for routing to a warm cache: every prompt's blocks are cached here
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: Reasoning | None = None
    include: list[str] | None = Field(default=None, max_length=0)

    @model_validator(mode="after")
    def _readable(self) -> "ResponsesRequest":
        self.messages()  # every input item can be read (a ValueError is a 400 naming it)
        if self.background and not self.store:
            raise ValueError("background responses are stored: background needs store true")
        return self

    def messages(self) -> list[dict]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out = []
        for i, item in enumerate(self.input):
            out += item_messages(item, f"input[{i}]")
        return merge_calls(out)

    def chat_request(self, history: list[dict]) -> ChatCompletionRequest:
        """The chat request for this turn: the instructions (never carried over from an earlier response), the
        earlier turns of `previous_response_id`, then this input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        tools: dict[str, Any] = {}
        if self.tools:
            choice = self.tool_choice
            tools = {"tools": [t.chat() for t in self.tools], "parallel_tool_calls": self.parallel_tool_calls,
                     "tool_choice": {"type": "function", "function": {"name": choice.name}} if isinstance(choice, NamedFunction)
                     else choice}
        elif self.tool_choice not in (None, "auto", "none"):
            raise ValueError("tool_choice needs tools")
        fmt = self.text.format if self.text is not None else None
        return ChatCompletionRequest(
            model=self.model, messages=[ChatMessage(**m) for m in merge_calls(system + history + self.messages())],
            max_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
            stream=self.stream, user=self.user, response_format=fmt.response_format() if fmt is not None else None, **tools)
