"""Engine outputs as OpenAI's Responses API objects: the response (its output items: a message of output_text, and
function_call items; usage; status "incomplete" at max_output_tokens), and its typed stream events
(response.created ... response.completed, each with its sequence_number)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request

from sieve.outputs import RequestOutput
from sieve.server.async_engine import EngineError
from sieve.server.streaming import split_deltas
from sieve.server.tools import ToolCallParser, tool_names


class ResponseBuilder:
    """One response: its settings as the request gave them, the output items made so far, and the conversation
    through its output (`history`, chat messages) for a later `previous_response_id`."""

    def __init__(self, rid: str, created: int, model_name: str, body, chat, history: list[dict], report_cached: bool):
        self.rid, self.created, self.model_name, self.body, self.chat = rid, created, model_name, body, chat
        self.history, self.report_cached = history, report_cached  # (the turns before this one, and this input)
        self.names = tool_names(chat.tools) if chat.tool_mode else None
        self.parallel = chat.parallel_tool_calls is not False
        self.items: list[dict] = []
        self.text, self.calls = "", []  # the output's text and calls (chat form), for `history`
        self.open_text = ""  # streaming: the text of the message item being written

    def parser(self) -> ToolCallParser | None:
        return ToolCallParser(self.names, self.parallel) if self.names is not None else None

    def message_item(self, text: str, status: str) -> dict:
        return {"type": "message", "id": f"msg_{self.rid[5:]}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or status == "completed" else []}

    def call_item(self, call: dict, status: str) -> dict:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

    def add_output(self, text: str, calls: list[dict]) -> None:
        self.text += text
        self.calls += [{k: v for k, v in c.items() if k != "index"} for c in calls]

    def conversation(self) -> list[dict]:
        """The turns through this response's output, as the next turn's `previous_response_id` continues them."""
        out = {"role": "assistant", "content": self.text or None}
        if self.calls:
            out["tool_calls"] = self.calls
        return [*self.history, out]

    def response(self, status: str, out: RequestOutput | None = None, error: dict | None = None) -> dict:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text is not None and b.text.format is not None \
            else {"type": "text"}
        tool_choice = b.tool_choice.model_dump() if hasattr(b.tool_choice, "model_dump") else b.tool_choice or "auto"
        incomplete = status == "incomplete"
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status, "model": self.model_name,
            "output": list(self.items), "usage": self.usage(out) if out is not None else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "previous_response_id": b.previous_response_id, "temperature": b.temperature, "top_p": b.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []], "tool_choice": tool_choice,
            "parallel_tool_calls": b.parallel_tool_calls is not False, "text": {"format": fmt},
            "metadata": b.metadata or {}, "store": b.store, "background": b.background, "truncation": "disabled",
            "reasoning": {"effort": None, "summary": None}, "user": b.user,
        }

    def usage(self, out: RequestOutput) -> dict:
        inputs, outputs = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
        cached = out.num_cached_tokens if self.report_cached else 0
        return {"input_tokens": inputs, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": outputs,
                "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": inputs + outputs}

    @staticmethod
    def status_of(out: RequestOutput) -> str:
        return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"

    def full(self, out: RequestOutput) -> dict:
        """The finished response, its output parsed into items."""
        parser, text = self.parser(), out.outputs[0].text
        calls: list = []
        if parser is not None:
            text, calls = parser.feed(text)
            text += parser.finish()
        self.add_output(text, calls)
        status = self.status_of(out)
        if text:
            self.items.append(self.message_item(text, "completed" if status == "completed" else "incomplete"))
        self.items += [self.call_item(c, "completed") for c in calls]
        return self.response(status, out)

    async def events(self, raw: Request, gen, first: RequestOutput, done: Callable[[dict], None]) -> AsyncIterator[str]:
        """The response's typed events as its tokens come; `done(response)` once it has finished (to store it)."""
        stream = EventWriter()
        yield stream.event("response.created", response=self.response("in_progress"))
        yield stream.event("response.in_progress", response=self.response("in_progress"))
        out, text_open = first, False
        try:
            async for out, text, calls in split_deltas(raw, gen, first, self.parser()):
                if text:
                    if not text_open:
                        text_open = True
                        for e in self.open_message(stream):
                            yield e
                    self.add_output(text, [])
                    self.open_text += text
                    yield stream.event("response.output_text.delta", item_id=self.items[-1]["id"], output_index=len(self.items) - 1,
                                       content_index=0, delta=text, logprobs=[])
                for call in calls:
                    if text_open:
                        text_open = False
                        for e in self.close_message(stream, "completed"):
                            yield e
                    for e in self.call_events(stream, call):
                        yield e
        except EngineError as e:
            yield stream.event("error", code="engine_error", message=str(e), param=None)
            return
        if not out.finished:
            return  # the client went away
        status = self.status_of(out)
        if text_open:
            for e in self.close_message(stream, "completed" if status == "completed" else "incomplete"):
                yield e
        final = self.response(status, out)
        done(final)
        yield stream.event(f"response.{status}", response=final)

    def open_message(self, stream: "EventWriter") -> list[str]:
        self.open_text = ""
        self.items.append(self.message_item("", "in_progress"))
        index, item = len(self.items) - 1, self.items[-1]
        return [stream.event("response.output_item.added", output_index=index, item=item),
                stream.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def close_message(self, stream: "EventWriter", status: str) -> list[str]:
        index = len(self.items) - 1
        item = self.items[index] = self.message_item(self.open_text, status)
        part = item["content"][0] if item["content"] else {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [stream.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                             text=self.open_text, logprobs=[]),
                stream.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part),
                stream.event("response.output_item.done", output_index=index, item=item)]

    def call_events(self, stream: "EventWriter", call: dict) -> list[str]:
        self.add_output("", [call])
        item = self.call_item(call, "completed")
        self.items.append(item)
        index = len(self.items) - 1
        return [stream.event("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}),
                stream.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=item["arguments"]),
                stream.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             name=item["name"], arguments=item["arguments"]),
                stream.event("response.output_item.done", output_index=index, item=item)]


class EventWriter:
    """Server-sent events numbered in order (`sequence_number`), each named as its `type`."""

    def __init__(self) -> None:
        self.number = 0

    def event(self, kind: str, **data) -> str:
        body = {"type": kind, "sequence_number": self.number, **data}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"
