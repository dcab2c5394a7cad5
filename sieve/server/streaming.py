"""Server-sent events for a streamed request: the opening chunk per choice, one chunk per choice per step as the
request's prompts generate together, the usage chunk, `[DONE]`; an engine failure is an error event, a client
that goes away aborts its requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import Request

from sieve.server.async_engine import EngineError
from sieve.server.responses import ResponseFormat
from sieve.server.tools import ToolCallParser, tool_names


class EventStream:
    """One streamed request: `streams` holds (generator, first output) per prompt, each with `n` choices."""

    def __init__(self, fmt: ResponseFormat, rid: str, created: int, streams: list, n: int, chat: bool, body, n_top: int):
        self.fmt, self.rid, self.created, self.streams, self.n = fmt, rid, created, streams, n
        self.chat, self.body, self.n_top = chat, body, n_top
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.parsers = {} if chat and getattr(body, "tool_mode", False) else None  # choice index -> ToolCallParser
        self.prompt_lp_due = [set(range(n)) for _ in streams]  # choices whose prompt_logprobs are still to be sent
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}
        self.finals: list = []  # each prompt's final output (usage)

    def chunk(self, choices: list, **extra) -> str:
        return self.fmt.chunk(self.rid, self.obj, self.created, choices, **extra)

    def opening(self) -> list[str]:
        """The opening chunk per choice: the role (chat) or the echoed prompt."""
        out, body = [], self.body
        for p_idx, (_, first) in enumerate(self.streams):
            for i in range(self.n):
                if self.chat:
                    out.append(self.chunk([{"index": p_idx * self.n + i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]))
                elif getattr(body, "echo", False):
                    lp = self.fmt.prompt_logprobs_openai(first, self.n_top) if body.logprobs is not None else None
                    out.append(self.chunk([{"index": p_idx * self.n + i, "text": self.fmt.prompt_text(first), "logprobs": lp,
                                            "finish_reason": None}]))
        return out

    def step(self, p_idx: int, out) -> list[str]:
        """One chunk per choice of prompt `p_idx` that moved in this output, as OpenAI."""
        chunks, body = [], self.body
        echo = len(self.fmt.prompt_text(out)) if getattr(body, "echo", False) else 0
        for c, (text, ids) in zip(out.outputs, out.deltas):
            if not (text or ids or c.finish_reason):
                continue
            lp = self.fmt.logprobs(c, len(c.token_ids) - len(ids), self.chat, self.n_top, echo + len(c.text) - len(text)) \
                if c.logprobs is not None else None
            idx = p_idx * self.n + c.index
            if self.chat and self.parsers is not None:  # tools offered: calls leave the content as they complete
                parser = self.parsers.setdefault(idx, ToolCallParser(tool_names(body.tools), body.parallel_tool_calls is not False))
                content, calls = parser.feed(text)
                if c.finish_reason:
                    content += parser.finish()
                delta = {"content": content} if content else {}
                if calls:
                    delta["tool_calls"] = calls
                reason = "tool_calls" if c.finish_reason == "stop" and parser.calls else c.finish_reason
                chunks.append(self.chunk([{"index": idx, "delta": delta, "logprobs": lp, "finish_reason": reason}]))
            elif self.chat:
                chunks.append(self.chunk([{"index": idx, "delta": {"content": text} if text else {}, "logprobs": lp,
                                           "finish_reason": c.finish_reason}]))
            else:
                due = body.prompt_logprobs is not None and c.index in self.prompt_lp_due[p_idx]
                extra = {"prompt_logprobs": self.fmt.prompt_logprobs_vllm(out)} if due else {}
                self.prompt_lp_due[p_idx].discard(c.index)
                chunks.append(self.chunk([{"index": idx, "text": text, "logprobs": lp, "finish_reason": c.finish_reason, **extra}]))
        return chunks

    def finished(self, out) -> None:
        self.usage["prompt_tokens"] += len(out.prompt_token_ids)
        self.usage["completion_tokens"] += sum(len(c.token_ids) for c in out.outputs)
        self.finals.append(out)

    def usage_chunk(self) -> str | None:
        if not (self.body.stream_options and self.body.stream_options.include_usage):
            return None
        usage = dict(self.usage, total_tokens=self.usage["prompt_tokens"] + self.usage["completion_tokens"])
        usage["prompt_tokens_details"] = self.fmt.cached_details(self.finals)
        return self.chunk([], usage=usage)

    async def events(self, raw: Request) -> AsyncIterator[str]:
        # Bounded: a client that stops reading stops the pumps, and its outputs pile up in the engine's queue for
        # the request, whose backlog limit then ends it (--max-stream-backlog)
        queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(self.streams))
        pumps: list[asyncio.Task] = []
        try:
            for c in self.opening():
                yield c
            # the prompts of one request generate together; their chunks interleave as they come
            pumps = [asyncio.create_task(pump(i, gen, first, queue)) for i, (gen, first) in enumerate(self.streams)]
            remaining = len(self.streams)
            while remaining:
                p_idx, out = await queue.get()
                if isinstance(out, EngineError):  # an error event, then [DONE]: the client is told, never left waiting
                    yield error_event(str(out), "engine_error")
                    yield "data: [DONE]\n\n"
                    return
                for c in self.step(p_idx, out):
                    yield c
                if out.finished:
                    remaining -= 1
                    self.finished(out)
                elif await raw.is_disconnected():
                    return
            usage = self.usage_chunk()
            if usage is not None:
                yield usage
            if self.body.stream_options and self.body.stream_options.include_queue:
                yield self.chunk([], metrics={"queue_ms": queue_ms(self.finals)})
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            for task in pumps:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for gen, _ in self.streams:  # aborts whatever has not finished (the client went away)
                await gen.aclose()


async def pump(p_idx: int, gen, first, queue: asyncio.Queue) -> None:
    """Prompt `p_idx`'s outputs onto the request's queue (an engine failure too: the stream tells the client)."""
    await queue.put((p_idx, first))
    if not first.finished:
        try:
            async for out in gen:
                await queue.put((p_idx, out))
        except EngineError as e:
            await queue.put((p_idx, e))


def queue_ms(finals: list) -> float | None:
    """The longest time one of a request's prompts waited in the queue (arrival to first scheduled), in ms."""
    waits = [o.metrics.first_scheduled_time - o.metrics.arrival_time for o in finals
             if o.metrics is not None and o.metrics.first_scheduled_time is not None]
    return round(1e3 * max(waits), 1) if waits else None


def queue_headers(estimates: list) -> dict[str, str]:
    """x-sieve-queue-position, x-sieve-queue-eta-ms and x-sieve-ttft-eta-ms: where a request's prompts stood when
    admitted (the last of them), as far as the engine could tell."""
    known = [e for e in estimates if e is not None]
    if not known:
        return {}
    headers = {"x-sieve-queue-position": str(max(e.position for e in known))}
    if all(e.start_s is not None for e in known):
        headers["x-sieve-queue-eta-ms"] = str(round(1e3 * max(e.start_s for e in known)))
    if all(e.first_token_s is not None for e in known):
        headers["x-sieve-ttft-eta-ms"] = str(round(1e3 * max(e.first_token_s for e in known)))
    return headers


def error_event(message: str, code: str, kind: str = "server_error") -> str:
    return "data: " + json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}) + "\n\n"



async def split_deltas(raw: Request, gen, first, parser: ToolCallParser | None) -> AsyncIterator[tuple[object, str, list]]:
    """One prompt's outputs as they come, each with its new text split into content and the tool calls completed in
    it (all content when `parser` is None): (output, content, calls). Ends at the finished output, or when the
    client goes away; an engine failure is raised to the caller (whose stream tells the client). Closes `gen`."""
    out = first
    try:
        while out is not None:
            text = out.deltas[0][0] if out.deltas else ""
            calls: list = []
            if parser is not None:
                text, calls = parser.feed(text)
                if out.outputs[0].finish_reason:
                    text += parser.finish()
            yield out, text, calls
            if out.finished or await raw.is_disconnected():
                return
            out = await anext(gen, None)
    finally:
        await gen.aclose()
