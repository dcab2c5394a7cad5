"""Tool calling in the Hermes format (Qwen's, NousResearch's): the tools are offered in the system prompt, the
model answers `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, and the server turns those blocks
into OpenAI `tool_calls`.

A chat template that renders tools itself gets them (`tools=`); one that does not (SmolLM2's) gets them in the
system message. `tool_choice` "required" or a named function is enforced by a grammar (structured outputs) over
the same format, so one parser serves every mode, streamed or not.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from sieve.structured import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _template_source(tokenizer) -> str:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return " ".join(t.values())
    return t or ""


def system_prompt(tools: list[dict]) -> str:
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + sigs + "\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
            "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def render_messages(messages: list[dict], tools: list[dict] | None, tokenizer) -> tuple[list[dict], dict]:
    """Messages ready for the chat template, and the extra keyword arguments it takes (`tools`)."""
    source = _template_source(tokenizer)
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls and "tool_calls" not in source:  # the template cannot show them: write them as the model would
            blocks = [f"{OPEN}\n" + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))},
                                                ensure_ascii=False) + f"\n{CLOSE}" for c in calls]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            del m["tool_calls"]
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if not tools:
        return out, {}
    if "tools" in source:
        return out, {"tools": tools}
    prompt = system_prompt(tools)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _arguments(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args if args is not None else {}


def tool_names(tools: list[dict] | None) -> set[str]:
    return {t["function"]["name"] for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)}


def check_tools(tools: list[dict], tool_choice: Any) -> str | None:
    """The named function of `tool_choice` (None for "auto"/"none"/"required"); ValueError on a bad pair."""
    names = []
    for i, t in enumerate(tools or []):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": {{...}}}}}}")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema (an object)")
        names.append(f["name"])
    if tool_choice in (None, "auto", "none"):
        return None
    if not tools:
        raise ValueError("tool_choice needs tools")
    if tool_choice == "required":
        return None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
        return name
    raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def constraint(tools: list[dict], tool_choice: Any, parallel: bool) -> StructuredOutputsParams | None:
    """The grammar that enforces tool_choice "required" (one call, or several with parallel_tool_calls) or a
    named function (one call of it); None for "auto" and "none"."""
    named = check_tools(tools, tool_choice)
    if tool_choice != "required" and named is None:
        return None
    fns = [t["function"] for t in tools if named is None or t["function"]["name"] == named]
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}}} for f in fns]
    schema = {**(options[0] if len(options) == 1 else {"anyOf": options}), "x-guidance": _COMPACT}
    call = f'"{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'
    start = 'call ("\\n" call)*' if parallel and named is None else "call"
    return StructuredOutputsParams(grammar=f"start: {start}\ncall: {call}\n")


class ToolCallParser:
    """Splits a choice's text, as it streams, into content and tool calls. `feed(delta)` returns the content
    that is safe to show and the calls completed in it; `finish()` flushes what is left (an unclosed or
    malformed call is content: nothing the model wrote is dropped). With `names`, a call to a function that was not
    offered is content too; with `parallel` False (`parallel_tool_calls: false`), so is every call after the first."""

    def __init__(self, names: set[str] | None = None, parallel: bool = True) -> None:
        self.names, self.parallel = names, parallel
        self.buffer = ""
        self.space = ""  # trailing whitespace of the content so far, held back: after the last tool call it is dropped
        self.calls: list[dict] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content, new = self._feed(text)
        content = self.space + content
        kept = content.rstrip()
        self.space = content[len(kept):]
        return kept, new

    def _feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, new = "", []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.buffer, OPEN)  # a tail that may still become "<tool_call>"
                content += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return content, new
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                content += self.buffer[:start]
                self.buffer = self.buffer[start:]
                return content, new
            body = self.buffer[start + len(OPEN): end]
            call = _parse_call(body)
            if call is None or (self.names is not None and call["function"]["name"] not in self.names) \
                    or (self.calls and not self.parallel):
                content += self.buffer[: end + len(CLOSE)]
            else:
                content += self.buffer[:start]
                call["index"] = len(self.calls)
                self.calls.append(call)
                new.append(call)
            self.buffer = self.buffer[end + len(CLOSE):]

    def finish(self) -> str:
        rest, self.buffer, space, self.space = self.buffer, "", self.space, ""
        return rest if self.calls else space + rest


def _partial_suffix(text: str, token: str) -> int:
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


def _parse_call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


def parse_tool_calls(text: str, names: set[str] | None = None, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """A whole output: its content (None when it is only tool calls) and its calls; the same as streaming it."""
    p = ToolCallParser(names, parallel)
    content, _ = p.feed(text)
    content += p.finish()
    calls = [{k: v for k, v in c.items() if k != "index"} for c in p.calls]
    return (content or None) if calls else content, calls
