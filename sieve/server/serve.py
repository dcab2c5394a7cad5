"""Run the app under uvicorn with a graceful SIGTERM/SIGINT: stop accepting, let requests in flight
finish for `grace` seconds, then abort the rest (each stream gets a final 'abort' chunk and [DONE])
and exit once the connections have closed."""

from __future__ import annotations

import logging
import threading

import uvicorn

log = logging.getLogger("sieve")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, async_engine, grace: float):
        super().__init__(config)
        self.async_engine = async_engine
        self.grace = grace
        self._timer: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._timer is None:
            log.warning("shutting down: no new requests; aborting what is still running in %.1f s", self.grace)
            self._timer = threading.Timer(self.grace, self.async_engine.abort_all)
            self._timer.daemon = True
            self._timer.start()
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after shutting down; ours is handled, so exit with status 0
        getattr(self, "_captured_signals", []).clear()


def serve(app, host: str, port: int, grace: float) -> int:
    """Serve until SIGTERM/SIGINT (exit status 0) or until the engine thread dies (status 1, after every
    client has been sent its error), so that a supervisor restarts the process."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace + 10)
    server = GracefulServer(config, app.state.async_engine, grace)

    def on_dead(error: BaseException) -> None:
        log.error("the engine cannot continue (%s: %s); shutting down with exit status 1", type(error).__name__, error)
        server.should_exit = True

    app.state.async_engine.on_dead = on_dead
    server.run()
    return 1 if app.state.async_engine.error is not None else 0


def serve_in_thread(app, host: str = "127.0.0.1") -> tuple[str, callable]:
    """Any ASGI app on a free port of `host`, from a daemon thread (benchmarks and tests); returns
    (http://host:port, stop)."""
    import socket
    import time

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline and thread.is_alive():
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError(f"the server on {host}:{port} did not start")

    def stop():
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://{host}:{port}", stop
