"""`sieve run-batch -i in.jsonl -o out.jsonl`: OpenAI's batch file format run offline (as vLLM's run-batch), through
the same server code and Batch API runner as `sieve serve --batch-dir`, in process, with no port opened. Every line
gets an output line, in the input's order: its response, or its error (a line that is not a request among them)."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time

import httpx

from sieve.server.app import create_app
from sieve.server.batch_store import ENDPOINTS


def endpoint_of(content: bytes) -> str:
    """The batch's endpoint: the url of its first line that names one (vLLM's run-batch takes one per file too)."""
    for raw in content.decode("utf-8", errors="replace").splitlines():
        try:
            url = json.loads(raw).get("url")
        except (json.JSONDecodeError, AttributeError):
            continue
        if url in ENDPOINTS:
            return url
    return ENDPOINTS[0]


async def run_file(engine, content: bytes, directory: str, model_name: str | None) -> tuple[list[str], dict]:
    app = create_app(engine, served_model_name=model_name, api_key=None, batch_dir=directory, webui=False)
    runner, st = app.state.batch_runner, app.state.sieve
    runner.max_in_flight = engine.config.max_num_seqs  # nothing interactive to leave room for
    headers = {"x-sieve-internal": st.internal_secret, "x-sieve-tenant": ""}
    task = asyncio.create_task(runner.run())
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sieve.batch") as client:
            f = (await client.post("/v1/files", files={"file": ("input.jsonl", content)}, data={"purpose": "batch"},
                                   headers=headers)).json()
            r = await client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": endpoint_of(content),
                                                       "completion_window": "24h"}, headers=headers)
            batch = r.json()
            while batch["status"] not in ("completed", "cancelled", "expired"):
                await asyncio.sleep(0.05)
                batch = (await client.get(f"/v1/batches/{batch['id']}", headers=headers)).json()
            out = []
            for key in ("output_file_id", "error_file_id"):
                if batch[key]:
                    text = (await client.get(f"/v1/files/{batch[key]}/content", headers=headers)).text
                    out += text.splitlines()
    finally:
        await runner.stop(task)
        st.aengine.stop()
    out.sort(key=lambda line: int(json.loads(line)["id"].rsplit("_", 1)[1]))  # the input's order
    return out, batch["request_counts"]


def run_batch(engine, input_path: str, output_path: str, model_name: str | None = None) -> dict:
    """Run `input_path`'s requests, write every line's result to `output_path`; the request counts."""
    with open(input_path, "rb") as f:
        content = f.read()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sieve-run-batch-") as directory:
        lines, counts = asyncio.run(run_file(engine, content, directory, model_name))
    with open(output_path, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    return {**counts, "seconds": round(time.perf_counter() - started, 2)}
