"""Anthropic's Messages API request bodies (pydantic), translated into the chat request the rest of the server already
serves: system prompt, turns of content blocks, tools and tool results, stop sequences.

Every field Anthropic's API defines is declared. The ones sieve does not implement pass only with their no-op values
(`thinking` disabled), and any other value is a 400 naming the field, as on the OpenAI routes. An image or document
block is a 400 too: this model reads text, and the block would be dropped."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sieve.server.protocol import ChatCompletionRequest, ChatMessage

TEXT_KEYS = {"type", "text", "cache_control", "citations"}  # cache_control: prompt caching here is automatic


def block_error(where: str, block: Any) -> str | None:
    """Why a content block cannot be read here, or None."""
    if not isinstance(block, dict):
        return f"{where} must be a content block (an object with a `type`)"
    kind = block.get("type")
    allowed = {"text": TEXT_KEYS, "tool_use": {"type", "id", "name", "input", "cache_control"},
               "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"}}.get(kind)
    if allowed is None:
        return f"{where}: a {kind!r} block is not supported: this model reads text, tool_use and tool_result blocks"
    extra = sorted(set(block) - allowed)
    if extra:
        return f"{where}.{extra[0]}: unknown field of a {kind} block"
    if kind == "text" and not isinstance(block.get("text"), str):
        return f"{where}.text must be a string"
    if kind == "tool_use" and not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                                   and isinstance(block.get("input"), dict)):
        return f"{where}: a tool_use block needs a string id and name and an object input"
    if kind == "tool_result":
        if not isinstance(block.get("tool_use_id"), str):
            return f"{where}.tool_use_id must be a string"
        content = block.get("content", "")
        if not isinstance(content, str):
            if not isinstance(content, list):
                return f"{where}.content must be a string or a list of text blocks"
            for j, part in enumerate(content):
                why = block_error(f"{where}.content[{j}]", part)
                if why is None and part.get("type") != "text":
                    why = f"{where}.content[{j}]: a tool result holds text blocks only here"
                if why is not None:
                    return why
    return None


def text_of(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(b["text"] for b in content if b.get("type") == "text")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]

    @model_validator(mode="after")
    def _blocks(self) -> "Message":
        for i, block in enumerate(self.content if isinstance(self.content, list) else []):
            why = block_error(f"content[{i}]", block)
            if why is None and block["type"] == "tool_use" and self.role != "assistant":
                why = f"content[{i}]: tool_use blocks come from the assistant"
            if why is None and block["type"] == "tool_result" and self.role != "user":
                why = f"content[{i}]: tool_result blocks come from the user"
            if why is not None:
                raise ValueError(why)
        return self

    def chat_messages(self) -> list[dict]:
        """This turn as OpenAI chat messages: tool results become `tool` messages (before the user's own text), and
        an assistant's tool_use blocks its tool_calls."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        out: list[dict] = []
        texts = [b["text"] for b in self.content if b["type"] == "text"]
        for b in self.content:
            if b["type"] == "tool_result":
                content = text_of(b.get("content", ""))
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": f"Error: {content}" if b.get("is_error") else content})
        calls = [{"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
                 for b in self.content if b["type"] == "tool_use"]
        if texts or calls or not out:
            out.append({"role": self.role, "content": "".join(texts) or None, **({"tool_calls": calls} if calls else {})})
        return out


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None

    def openai(self) -> dict:
        fn = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('`name` is required with type "tool", and only with it')
        return self

    def openai(self) -> str | dict:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["disabled"]  # extended thinking is not implemented: only its off switch passes


class CountTokensRequest(BaseModel):
    """/v1/messages/count_tokens: what a message request's prompt would be."""

    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @model_validator(mode="after")
    def _system_text(self) -> "CountTokensRequest":
        for i, block in enumerate(self.system if isinstance(self.system, list) else []):
            why = block_error(f"system[{i}]", block)
            if why is None and block["type"] != "text":
                why = f"system[{i}]: the system prompt holds text blocks only"
            if why is not None:
                raise ValueError(why)
        return self

    def chat_messages(self) -> list[ChatMessage]:
        out = [{"role": "system", "content": text_of(self.system)}] if self.system else []
        for m in self.messages:
            out += m.chat_messages()
        return [ChatMessage(**m) for m in out]

    def chat_tools(self) -> dict:
        """tools, tool_choice and parallel_tool_calls for the chat request (tool_choice "none" offers none)."""
        if not self.tools or (self.tool_choice is not None and self.tool_choice.type == "none"):
            return {}
        out: dict[str, Any] = {"tools": [t.openai() for t in self.tools]}
        if self.tool_choice is not None:
            out["tool_choice"] = self.tool_choice.openai()
            out["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        return out


class CacheControl(BaseModel):
    """Prompt caching: every prompt's blocks are cached here without asking, so the hint passes and changes nothing."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class JsonFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Structured outputs (`format`), through the same grammar as OpenAI's json_schema; `effort` is for models that
    think, and only its absence passes."""

    model_config = ConfigDict(extra="forbid")
    format: JsonFormat | None = None
    effort: None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # sieve's, as on its OpenAI routes: a sampled answer that can be had again
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: CacheControl | None = None
    output_config: OutputConfig | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as OpenAI's chat completion, which the server knows how to run."""
        return ChatCompletionRequest(
            model=self.model, messages=self.chat_messages(), max_tokens=self.max_tokens, stop=self.stop_sequences,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed, stream=self.stream,
            user=self.metadata.user_id if self.metadata is not None else None, response_format=self.response_format(),
            **self.chat_tools())

    def response_format(self) -> dict | None:
        fmt = self.output_config.format if self.output_config is not None else None
        return None if fmt is None else {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
