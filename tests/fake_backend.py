"""A deterministic OpenAI-compatible backend for the router tests: it answers "<name>: <prompt>" with one
logprob per word, and the prompt sets that logprob ("conf=-0.7"), so the tests choose a cascade's
confidence exactly. It counts its calls and keeps the bodies it received."""

from __future__ import annotations

import json
import re
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def _text(body: dict) -> str:
    if "messages" in body:
        return [m for m in body["messages"] if m.get("role") == "user"][-1]["content"]
    return body["prompt"]


def make_backend(name: str) -> FastAPI:
    app = FastAPI()
    app.state.calls = []

    def answer(body: dict, kind: str) -> dict:
        text = _text(body)
        m = re.search(r"conf=(-?[0-9.]+)", text)
        conf = float(m.group(1)) if m else -0.1
        words = f"{name}: {text}".split()[: body.get("max_tokens") or 1000]
        content = " ".join(words)
        n = body.get("n") or 1
        if kind == "chat":
            lp = None
            if body.get("logprobs"):
                k = body.get("top_logprobs") or 0
                lp = {"content": [{"token": w, "logprob": conf, "bytes": None,
                                   "top_logprobs": [{"token": w, "logprob": conf, "bytes": None}] +
                                   [{"token": f"alt{j}", "logprob": conf - 1 - j, "bytes": None} for j in range(k - 1)]}
                                  for w in words]}
            choices = [{"index": i, "message": {"role": "assistant", "content": content}, "logprobs": lp, "finish_reason": "stop"}
                       for i in range(n)]
            obj = "chat.completion"
        else:
            lp = None
            if body.get("logprobs") is not None:
                lp = {"tokens": words, "token_logprobs": [conf] * len(words), "top_logprobs": [{w: conf} for w in words],
                      "text_offset": [0] * len(words)}
            choices = [{"index": i, "text": content, "logprobs": lp, "finish_reason": "stop"} for i in range(n)]
            obj = "text_completion"
        return {"id": f"{name}-{len(app.state.calls)}", "object": obj, "created": int(time.time()), "model": body["model"],
                "choices": choices, "usage": {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}}

    async def handle(request: Request, kind: str):
        body = await request.json()
        app.state.calls.append(body)
        if "fail" in _text(body):
            return JSONResponse({"error": {"message": "bad prompt", "type": "invalid_request_error", "param": None, "code": None}},
                                status_code=400)
        out = answer(body, kind)
        if not body.get("stream"):
            return out

        def events():
            for w in out["choices"][0]["message"]["content"].split(" ") if kind == "chat" else out["choices"][0]["text"].split(" "):
                choice = ({"index": 0, "delta": {"content": w + " "}, "finish_reason": None} if kind == "chat"
                          else {"index": 0, "text": w + " ", "finish_reason": None})
                yield "data: " + json.dumps({"id": out["id"], "model": body["model"], "choices": [choice]}) + "\n\n"
            last = ({"index": 0, "delta": {}, "finish_reason": "stop"} if kind == "chat" else {"index": 0, "text": "", "finish_reason": "stop"})
            yield "data: " + json.dumps({"id": out["id"], "model": body["model"], "choices": [last]}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completions")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app
