"""The naive rung of `sieve bench ladder`: Hugging Face transformers' `generate` behind a minimal OpenAI-style
server, one request at a time (what serving looks like before an inference engine).

    python -m sieve.bench.naive_server --model FILE.gguf|FOLDER --port 8000 [--dtype float32]

Only what the ladder's clients send is served: GET /v1/models, POST /v1/chat/completions (streamed or not, with
max_tokens, temperature 0 (greedy) or sampling, ignore_eos) and /v1/completions. Requests queue on one lock: the
second user waits for the first answer to finish, which is exactly the rung's cost. Anything else is refused with
an OpenAI error object.
"""


import argparse
import asyncio
import json
import threading
import time
import uuid


KNOWN_FIELDS = {"model", "max_tokens", "temperature", "stream", "stream_options", "ignore_eos"}


class BadRequest(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status)


def parse_request(body, chat: bool, tokenizer, served_name: str) -> tuple[list[int], int, float]:
    """The prompt's token ids, max_tokens and temperature of a request body; BadRequest for anything else in it."""
    if not isinstance(body, dict):
        raise BadRequest(400, "the body must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS - {"messages" if chat else "prompt"})
    if unknown:  # a field this minimal server does not implement is refused, never silently ignored
        raise BadRequest(400, f"this naive server does not support: {', '.join(unknown)}")
    if body.get("model") not in (None, served_name):
        raise BadRequest(404, f"model {body.get('model')!r} does not exist", "model_not_found")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest(400, "max_tokens must be a positive integer")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(400, "messages must be a non-empty list")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
            raise BadRequest(400, "each message must be an object with a string role and string content")
        try:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # the template refuses these messages (roles out of order, ...)
            raise BadRequest(400, f"the chat template cannot render these messages: {e}") from None
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
    else:
        if not isinstance(body.get("prompt"), str):
            raise BadRequest(400, "prompt must be a string")
        ids = tokenizer(body["prompt"], add_special_tokens=True).input_ids
    temperature = body.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature <= 2:
        raise BadRequest(400, "temperature must be a number in [0, 2]")
    return ids, max_tokens, temperature


class Generation:
    """One request's `generate` on a worker thread, behind the server's lock (one request at a time), its text
    streamed by transformers' TextIteratorStreamer."""

    def __init__(self, model, tokenizer, lock: threading.Lock, ids: list[int], gen: dict):
        import torch
        from transformers import TextIteratorStreamer

        self.ids, self.num_generated, self.error = ids, 0, None
        self.streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)

        def run():
            try:
                with lock, torch.inference_mode():
                    out = model.generate(torch.tensor([ids]), streamer=self.streamer, **gen)
                self.num_generated = out.shape[1] - len(ids)
            except Exception as e:  # reaches the client as an error, and ends the stream it waits on
                self.error = f"generation failed: {type(e).__name__}: {e}"
                self.streamer.end()

        self.worker = threading.Thread(target=run, daemon=True)
        self.worker.start()

    async def pieces(self):
        it = iter(self.streamer)
        while True:
            text = await asyncio.to_thread(next, it, None)
            if text is None:
                break
            if text:
                yield text

    async def join(self) -> None:
        await asyncio.to_thread(self.worker.join)

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.ids), "completion_tokens": self.num_generated,
                "total_tokens": len(self.ids) + self.num_generated}


class Answer:
    """One request's response in OpenAI's shapes, whole or streamed."""

    def __init__(self, g: Generation, chat: bool, served_name: str, max_tokens: int, include_usage: bool):
        self.g, self.chat, self.served_name, self.max_tokens, self.include_usage = g, chat, served_name, max_tokens, include_usage
        self.rid, self.created = f"naive-{uuid.uuid4().hex[:12]}", int(time.time())

    def finish_reason(self) -> str:
        return "length" if self.g.num_generated >= self.max_tokens else "stop"

    def chunk(self, text: str | None, finish: str | None, usage: dict | None = None) -> str:
        if self.chat:
            choice = {"index": 0, "delta": ({"content": text} if text is not None else {}), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish}
        obj = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion", "created": self.created,
               "model": self.served_name, "choices": [choice]}
        if usage:
            obj["usage"] = usage
        return f"data: {json.dumps(obj)}\n\n"

    async def events(self):
        async for text in self.g.pieces():
            yield self.chunk(text, None)
        await self.g.join()
        if self.g.error:
            yield f"data: {json.dumps({'error': {'message': self.g.error, 'type': 'server_error', 'param': None, 'code': None}})}\n\n"
        else:
            yield self.chunk(None, self.finish_reason(), self.g.usage() if self.include_usage else None)
        yield "data: [DONE]\n\n"

    async def whole(self):
        text = "".join([t async for t in self.g.pieces()])
        await self.g.join()
        if self.g.error:
            return error_response(500, self.g.error, "server_error")
        finish = self.finish_reason()
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish} if self.chat
                  else {"index": 0, "text": text, "finish_reason": finish})
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.served_name, "choices": [choice], "usage": self.g.usage()}


def create_app(model_path: str, served_name: str, dtype: str = "float32", threads: int | None = None):
    import torch
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    from sieve.models.loader import open_checkpoint, resolve_model_path
    from sieve.train.kv_distill import load_hf_model

    if threads:
        torch.set_num_threads(threads)
    model = load_hf_model(model_path, getattr(torch, dtype)).eval()
    tokenizer = open_checkpoint(str(resolve_model_path(model_path))).tokenizer()  # as sieve reads the same file
    configured = model.generation_config.eos_token_id
    eos = [configured] if isinstance(configured, int) else list(configured or [])
    eos += [t for t in [tokenizer.eos_token_id] if t is not None and t not in eos]
    lock = threading.Lock()  # one request at a time
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "transformers"}]}

    async def complete(request: Request, chat: bool):
        try:
            try:
                body = await request.json()
            except json.JSONDecodeError:
                raise BadRequest(400, "the body is not JSON") from None
            ids, max_tokens, temperature = parse_request(body, chat, tokenizer, served_name)
        except BadRequest as e:
            return error_response(e.status, e.message, e.kind)
        gen = dict(max_new_tokens=max_tokens, do_sample=temperature > 0, pad_token_id=eos[0] if eos else 0, eos_token_id=eos or None)
        if temperature > 0:
            gen["temperature"] = temperature
        if body.get("ignore_eos"):
            gen["min_new_tokens"] = max_tokens
        answer = Answer(Generation(model, tokenizer, lock, ids, gen), chat, served_name, max_tokens,
                        bool((body.get("stream_options") or {}).get("include_usage")))
        if body.get("stream"):
            return StreamingResponse(answer.events(), media_type="text/event-stream")
        return await answer.whole()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, False)

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name", default="naive")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args(argv)
    uvicorn.run(create_app(args.model, args.served_model_name, args.dtype, args.num_threads), host=args.host,
                port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
