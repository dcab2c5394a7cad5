"""Soak: 64 streaming clients on 127.0.0.1, a third of them hanging up midway, faults injected into 1% of
model steps. Bounded (a fixed number of requests); it must end with no client hung, no KV block leaked,
every failed request told so (an error event, then [DONE]), and every other one complete and equal to
its output when run alone."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from live_server import API_KEY, start_server, wait_idle

CLIENTS, REQUESTS_PER_CLIENT, FAULT_EVERY = 64, 4, 100  # a fault in steps 50, 150, 250, ...: 1% of steps


def make_requests(seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    clients = []
    for c in range(CLIENTS):
        reqs = []
        for r in range(REQUESTS_PER_CLIENT):
            body = {"prompt": [rng.randrange(3, 4000) for _ in range(rng.randint(4, 40))], "max_tokens": rng.randint(8, 40),
                    "ignore_eos": True, "stream": True}
            if r % 2:
                body.update(temperature=0.9, top_p=0.95, seed=rng.randrange(10**6))
            else:
                body.update(temperature=0)
            reqs.append(body)
        clients.append(reqs)
    return clients


async def client(base: str, reqs: list[dict], hang_up: bool, log: list) -> None:
    h = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as http:
        for body in reqs:
            text, error, done, chunks = [], None, False, 0
            async with http.stream("POST", base + "/v1/completions", json=body, headers=h) as resp:
                if resp.status_code != 200:  # failed before its first token: an HTTP error in OpenAI's shape
                    assert resp.status_code == 500, await resp.aread()
                    log.append({"body": body, "text": "", "error": json.loads(await resp.aread())["error"], "done": True,
                                "hung_up": False})
                    continue
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        continue
                    chunks += 1
                    text += [c["text"] for c in event["choices"]]
                    if hang_up and chunks == body["max_tokens"] // 2:  # midway: close the connection
                        break
            log.append({"body": body, "text": "".join(text), "error": error, "done": done, "hung_up": hang_up and not done})


def test_soak_64_streams_disconnects_and_step_faults(llama_dir, llama_engine_factory):
    from sieve import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=400, max_model_len=128,
                                    max_num_seqs=64))
    runner, real_execute, counter = engine.runner, engine.runner.execute, {"steps": 0, "faults": 0}

    def execute(sched):
        counter["steps"] += 1
        if counter["steps"] % FAULT_EVERY == FAULT_EVERY // 2:
            counter["faults"] += 1
            raise RuntimeError("injected step fault")
        return real_execute(sched)

    runner.execute = execute
    base, stop = start_server(engine)
    plan = make_requests()
    log: list = []
    try:
        async def main():
            tasks = [asyncio.create_task(client(base, reqs, hang_up=(i % 3 == 0), log=log)) for i, reqs in enumerate(plan)]
            done, pending = await asyncio.wait(tasks, timeout=600)
            for t in pending:
                t.cancel()
            for t in done:
                t.result()  # a client-side assertion surfaces here
            return len(pending)

        hung = asyncio.run(main())
        wait_idle(engine, timeout=30)
        aengine = stop.app.state.async_engine
        leaked = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
        failed = [e for e in log if e["error"] is not None]
        finished = [e for e in log if e["error"] is None and not e["hung_up"]]
        print(f"soak: {len(log)} requests, {counter['steps']} steps, {counter['faults']} injected faults, {len(failed)} failed, "
              f"{sum(e['hung_up'] for e in log)} hung up by their client, {len(finished)} complete, {hung} hung clients, "
              f"{leaked} leaked blocks")
        assert hung == 0 and len(log) == CLIENTS * REQUESTS_PER_CLIENT
        assert leaked == 0 and not engine.requests and not engine.has_unfinished() and not aengine._queues
        assert counter["faults"] >= 1 and failed and all(e["done"] for e in failed)  # told, then [DONE]
        assert all(e["error"]["code"] == "engine_error" for e in failed)
        assert sum(e["hung_up"] for e in log) >= CLIENTS // 3 * REQUESTS_PER_CLIENT - len(failed)
        assert len(finished) > len(log) // 3
    finally:
        stop()
    # every request neither failed nor hung up: exactly its output when run alone
    params = [SamplingParams(max_tokens=e["body"]["max_tokens"], ignore_eos=True, temperature=e["body"]["temperature"],
                             top_p=e["body"].get("top_p", 1.0), seed=e["body"].get("seed")) for e in finished]
    want = llama_engine_factory(max_model_len=128).generate([{"prompt_token_ids": e["body"]["prompt"]} for e in finished], params)
    assert [e["text"] for e in finished] == [w.outputs[0].text for w in want]
