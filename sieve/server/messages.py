"""Engine outputs in Anthropic's Messages shapes: the whole message (text and tool_use blocks, stop_reason, usage) and
its server-sent events (message_start, content_block_start/delta/stop, message_delta, message_stop; an engine
failure is an `error` event)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from sieve.outputs import CompletionOutput, RequestOutput
from sieve.server.async_engine import EngineError
from sieve.server.errors import anthropic_body
from sieve.server.streaming import split_deltas
from sieve.server.tools import ToolCallParser, parse_tool_calls, tool_names


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def tool_use(call: dict) -> dict:
    """An OpenAI tool call as Anthropic's tool_use block."""
    args = json.loads(call["function"]["arguments"] or "{}")
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call["function"]["name"],
            "input": args if isinstance(args, dict) else {"value": args}}


def stop_of(c: CompletionOutput, stop_sequences: list[str] | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a finished choice."""
    if called:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str) and c.stop_reason in (stop_sequences or []):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


class MessageFormat:
    """One message request's answers; `chat`: the chat request it was translated into (its tools), `report_cached`:
    whether usage may tell the prefix cache's hits (not where they may be another tenant's)."""

    def __init__(self, rid: str, model_name: str, chat, stop_sequences: list[str] | None, report_cached: bool):
        self.rid, self.model_name, self.chat, self.stop_sequences = rid, model_name, chat, stop_sequences
        self.report_cached = report_cached
        self.names = tool_names(chat.tools) if chat.tool_mode else None

    def usage(self, out: RequestOutput, output_tokens: int) -> dict:
        cached = out.num_cached_tokens if self.report_cached else 0
        return {"input_tokens": len(out.prompt_token_ids) - cached, "output_tokens": output_tokens,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def message(self, out: RequestOutput, content: list, stop: tuple[str | None, str | None], output_tokens: int) -> dict:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model_name, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": self.usage(out, output_tokens)}

    def full(self, out: RequestOutput) -> dict:
        c = out.outputs[0]
        text, calls = c.text, []
        if self.names is not None:
            text, calls = parse_tool_calls(c.text, self.names, self.chat.parallel_tool_calls is not False)
        content = ([{"type": "text", "text": text}] if text else []) + [tool_use(call) for call in calls]
        return self.message(out, content, stop_of(c, self.stop_sequences, bool(calls)), len(c.token_ids))

    async def events(self, raw: Request, gen, first: RequestOutput) -> AsyncIterator[str]:
        """The message's events as its tokens come. Text streams as text_delta events; with tools offered, each
        completed call is a tool_use block whose input comes in one input_json_delta."""
        parser = ToolCallParser(self.names, self.chat.parallel_tool_calls is not False) if self.names is not None else None
        yield sse("message_start", {"type": "message_start", "message": self.message(first, [], (None, None), 0)})
        blocks, out = Blocks(), first
        try:
            async for out, text, calls in split_deltas(raw, gen, first, parser):
                for event in blocks.text(text):
                    yield event
                for call in calls:
                    for event in blocks.tool(tool_use(call)):
                        yield event
        except EngineError as e:  # an error event: the client is told, never left waiting
            yield sse("error", anthropic_body(500, str(e), "server_error"))
            return
        if not out.finished:
            return  # the client went away
        c = out.outputs[0]
        for event in blocks.close():
            yield event
        stop = stop_of(c, self.stop_sequences, bool(parser is not None and parser.calls))
        yield sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                    "usage": {"output_tokens": len(c.token_ids)}})
        yield sse("message_stop", {"type": "message_stop"})


class Blocks:
    """The content blocks of a streamed message: the open text block, and the index of the next."""

    def __init__(self) -> None:
        self.index, self.text_open = 0, False

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        out = []
        if not self.text_open:
            out.append(sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                   "content_block": {"type": "text", "text": ""}}))
            self.text_open = True
        out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                               "delta": {"type": "text_delta", "text": text}}))
        return out

    def tool(self, block: dict) -> list[str]:
        out = self.close()
        out.append(sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": {**block, "input": {}}}))
        out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                               "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}))
        out.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.index += 1
        return out

    def close(self) -> list[str]:
        if not self.text_open:
            return []
        self.text_open = False
        self.index += 1
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})]
