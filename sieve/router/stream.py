"""Streams and whole answers, both ways: `assemble` turns a proxied stream's chunks into the answer the
cache keeps; `replay` turns a cached (or a cascade's accepted) answer into a stream in OpenAI's chunk shape."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator


def assemble(chunks: list[dict], kind: str) -> dict | None:
    """The non-streamed answer the chunks add up to; None when they cannot be cached as text (tool-call
    deltas, logprobs, an error, or a choice that never finished)."""
    if not chunks or any("error" in c for c in chunks):
        return None
    first = chunks[0]
    choices: dict[int, dict] = {}
    usage = None
    for c in chunks:
        usage = c.get("usage") or usage
        for ch in c.get("choices") or []:
            if ch.get("logprobs"):
                return None
            i = ch.get("index", 0)
            out = choices.setdefault(i, {"index": i, "text": "", "role": "assistant", "finish_reason": None})
            if kind == "chat":
                delta = ch.get("delta") or {}
                if delta.get("tool_calls"):
                    return None
                out["role"] = delta.get("role") or out["role"]
                out["text"] += delta.get("content") or ""
            else:
                out["text"] += ch.get("text") or ""
            out["finish_reason"] = ch.get("finish_reason") or out["finish_reason"]
    if not choices or any(c["finish_reason"] is None for c in choices.values()):
        return None
    ordered = [choices[i] for i in sorted(choices)]
    if kind == "chat":
        out_choices = [{"index": c["index"], "message": {"role": c["role"], "content": c["text"]}, "logprobs": None,
                        "finish_reason": c["finish_reason"]} for c in ordered]
        obj = "chat.completion"
    else:
        out_choices = [{"index": c["index"], "text": c["text"], "logprobs": None, "finish_reason": c["finish_reason"]} for c in ordered]
        obj = "text_completion"
    answer = {"id": first.get("id"), "object": obj, "created": first.get("created", int(time.time())),
              "model": first.get("model"), "choices": out_choices}
    if usage is not None:
        answer["usage"] = usage
    return answer


def replay(answer: dict, kind: str, include_usage: bool) -> Iterator[str]:
    """One content chunk per choice (after the role chunk for chat), then each finish reason, usage when asked, [DONE]."""
    head = {"id": answer.get("id"), "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": answer.get("created", int(time.time())), "model": answer.get("model")}

    def event(choices: list[dict], **extra) -> str:
        return "data: " + json.dumps(dict(head, choices=choices, **extra)) + "\n\n"

    for ch in answer.get("choices") or []:
        i = ch.get("index", 0)
        if kind == "chat":
            msg = ch.get("message") or {}
            yield event([{"index": i, "delta": {"role": msg.get("role", "assistant"), "content": ""}, "logprobs": None, "finish_reason": None}])
            delta = {"content": msg.get("content") or ""}
            if msg.get("tool_calls"):
                delta["tool_calls"] = [dict(tc, index=j) for j, tc in enumerate(msg["tool_calls"])]
            yield event([{"index": i, "delta": delta, "logprobs": ch.get("logprobs"), "finish_reason": None}])
            yield event([{"index": i, "delta": {}, "logprobs": None, "finish_reason": ch.get("finish_reason")}])
        else:
            yield event([{"index": i, "text": ch.get("text") or "", "logprobs": ch.get("logprobs"), "finish_reason": None}])
            yield event([{"index": i, "text": "", "logprobs": None, "finish_reason": ch.get("finish_reason")}])
    if include_usage and answer.get("usage") is not None:
        yield event([], usage=answer["usage"])
    yield "data: [DONE]\n\n"
