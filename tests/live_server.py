"""A sieve server on a free port of 127.0.0.1, run from a thread, for the tests that need a live one."""

from __future__ import annotations

import time

API_KEY = "test-key"
MODEL = "tiny-llama"
SMOLLM2 = "smollm2-135m-instruct"  # the name the default model is served under


def start_server(engine, served_model_name: str | None = MODEL, **app_kwargs):
    """Serve `engine` on a free port of 127.0.0.1 from a thread; returns (base url, stop function).
    `served_model_name` None: the engine's own name."""
    from sieve.server.app import create_app

    app_kwargs.setdefault("api_key", API_KEY)
    return serve_app(create_app(engine, served_model_name=served_model_name, **app_kwargs))


def serve_app(app):
    """Any ASGI app on a free port of 127.0.0.1 from a thread; returns (base url, stop function)."""
    from sieve.server.serve import serve_in_thread

    url, stop = serve_in_thread(app)
    stop.app = app  # for the tests that reach into the running server (fault injection)
    return url, stop


def metrics_page(base: str) -> str:
    """/metrics, which needs the API key when the server has one (unless it runs with metrics_public)."""
    import httpx

    return httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text


def wait_idle(engine, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.05)


def faulty_engine(model_dir):
    """A float32 engine on `model_dir` whose step raises "injected fault" at the call `state["fail_at"]` names
    (`state["calls"]` counts them): (engine, state)."""
    from sieve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=256))
    real_step, state = engine.step, {"calls": 0, "fail_at": None}

    def step():
        state["calls"] += 1
        if state["calls"] == state["fail_at"]:
            raise RuntimeError("injected fault")
        return real_step()

    engine.step = step
    return engine, state
