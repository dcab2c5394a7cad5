"""Drives the engine from a thread of its own so the event loop never blocks on a model step.

Requests and aborts cross into the engine thread through a lock-protected inbox; outputs cross
back to each request's asyncio.Queue with `call_soon_threadsafe`.

Failures reach every affected client: a step that raises fails the requests it held (each gets an
`EngineError`, and the engine goes on with the others and new ones); anything else that raises in the engine thread
kills it, fails every request in flight or waiting, and leaves `error` set, which /health reports as
503 and `sieve serve` turns into a non-zero exit. `last_progress` is when the thread last finished a
step or found nothing to do, for /health's stall check.

Given a factory instead of an engine, the engine is also built in that thread, and should be: with
GNU OpenMP (PyTorch's CPU threads), every thread that starts parallel work gets a team of its own, and
once the teams hold more threads than there are CPUs, libgomp stops spin-waiting between parallel
regions, so each of a step's ~150 regions begins with a sleeping thread being woken. A model loaded
by the main thread and stepped by this one measured 38 ms per batch-1 step of a 0.5B model on 2 cores,
against 26 ms when one thread does both.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from sieve.engine import EngineDead, LLMEngine, Prompt, RequestError, StepFailed
from sieve.outputs import RequestOutput
from sieve.sampling_params import SamplingParams

log = logging.getLogger("sieve")


class EngineError(RuntimeError):
    """The engine could not finish a request: a failed step, or a dead engine thread."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], on_finished=None, max_backlog: int = 256):
        """`engine`: an engine, or a function that builds one (called in the engine thread; its errors
        are raised here). `max_backlog`: outputs a stream may leave unread; past it the reader is too slow, and its
        request is aborted and its stream ended with an error (each output holds the text so far: an unread stream
        would otherwise grow without bound)."""
        self.on_finished = on_finished  # called in the engine thread with each request's final output
        self.max_backlog = max_backlog
        self.on_slow_reader: Callable[[str], None] | None = None  # called on the event loop with each request cut
        self.num_slow_readers = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[tuple] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.error: BaseException | None = None  # set when the engine thread died
        self.last_progress = time.monotonic()
        self.on_dead: Callable[[BaseException], None] | None = None  # called in the engine thread when it dies
        self.engine: LLMEngine | None = None
        self._kv_pool: ThreadPoolExecutor | None = None  # a decode server's KV fetches
        # A test hook: seconds added to every step (SIEVE_DEBUG_STEP_DELAY), so that tests of timing-dependent
        # behaviour (graceful shutdown) control how long a request runs instead of racing the CPU.
        self.step_delay = float(os.environ.get("SIEVE_DEBUG_STEP_DELAY", "0"))
        failed: list[BaseException] = []
        ready = threading.Event()

        def run() -> None:
            try:
                self.engine = engine if isinstance(engine, LLMEngine) else engine()
            except BaseException as e:  # raised by the constructor below
                failed.append(e)
                return
            finally:
                ready.set()
            self._loop()

        self._thread = threading.Thread(target=run, name="sieve-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    # ---- called from the event loop --------------------------------------------------------
    async def submit(self, requests: list[tuple]) -> list["RequestStream"]:
        """Admit (request id, prompt, params, priority[, (tenant, tier)]) requests together: they reach the engine in one
        drain of the inbox, so they join the same step. All or none: if the engine refuses one, the others
        are aborted and its error is raised here, before any output. The caller owns the streams and
        must `aclose()` each one it does not read to the end."""
        loop = asyncio.get_running_loop()
        fetched = await self._fetch_kv(requests)
        entries = []
        with self._lock:
            if self.error is not None:
                raise EngineError(f"the engine has stopped after an internal error: {self.error}")
            for rid, prompt, params, priority, *tenancy in requests:
                queue = StreamQueue()
                done = loop.create_future()
                self._queues[rid] = (loop, queue)
                self._inbox.append(("add", rid, prompt, params, priority, done, fetched.get(rid),
                                    tenancy[0] if tenancy else (None, None)))
                entries.append((rid, queue, done))
        self._wake.set()
        streams = [RequestStream(self, rid, queue) for rid, queue, _ in entries]
        try:
            results = await asyncio.gather(*(done for _, _, done in entries), return_exceptions=True)
        except BaseException:  # cancelled (the client went away): nothing it asked for may keep running
            for stream in streams:
                await stream.aclose()
            raise
        refused = [r for r in results if isinstance(r, BaseException)]
        if refused:
            for stream in streams:
                await stream.aclose()
            raise refused[0]
        for stream, estimate in zip(streams, results):
            stream.queue_estimate = estimate
        return streams

    async def _fetch_kv(self, requests) -> dict:
        """A decode server's KV transfers, and the KV tiers' reads, before admission and off the engine thread (each
        within its deadline), so that a slow or dead producer or tier delays only its own request. Params it may not
        act on are refused here."""
        fetched = {}
        for rid, prompt, params, *_ in requests:
            ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt if isinstance(prompt, list) else None
            if self.engine.check_kv_transfer(params.kv_transfer_params):
                if ids is None:
                    raise RequestError("kv_transfer_params.do_remote_prefill needs the prompt as token ids")
                fetch, args = self.engine.fetch_kv, (list(ids), params.kv_transfer_params)
            elif (self.engine.kv_tiers is not None and ids is not None and params.kv_transfer_params is None
                  and not params.whole_prompt):
                try:  # (the namespace its blocks are hashed in: its adapter's too)
                    salt = self.engine.cache_salt(params)
                except ValueError as e:
                    raise RequestError(str(e)) from None
                fetch, args = self.engine.fetch_tiers, (list(ids), salt)  # the KV tiers' blocks, read here
            else:
                continue
            if self._kv_pool is None:
                self._kv_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sieve-kv-fetch")
            fetched[rid] = await asyncio.get_running_loop().run_in_executor(self._kv_pool, fetch, *args)
        return fetched

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """One request: yields its outputs as it progresses; aborts it if the consumer goes away."""
        [stream] = await self.submit([(request_id, prompt, params, priority)])
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    @property
    def num_pending(self) -> int:
        """Requests handed to the engine thread but not yet in its queues."""
        with self._lock:
            return sum(1 for cmd in self._inbox if cmd[0] == "add")

    def num_pending_in(self, tier: str) -> int:
        """Requests of `tier` handed to the engine thread but not yet in its queues."""
        with self._lock:
            return sum(1 for cmd in self._inbox if cmd[0] == "add" and cmd[7][1] == tier)

    async def queue_estimate(self, request_id: str):
        """Where an admitted request stands now (sieve.queue_eta.QueueEstimate), from the engine thread between steps;
        None once it is gone."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        with self._lock:
            self._inbox.append(("estimate", request_id, loop, answer))
        self._wake.set()
        return await answer

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    def abort_all(self) -> None:
        """Abort every request in flight; each stream then receives its final ('abort') output."""
        with self._lock:
            ids = list(self._queues)
        for rid in ids:
            self.abort(rid)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        engine = getattr(self, "engine", None)
        if engine is not None and not self._thread.is_alive() and hasattr(engine, "shutdown"):
            engine.shutdown()  # its worker processes (tensor parallelism), if any

    # ---- the engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopped:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self.engine.check_alive()  # idle too: a dead rank ends the server now, not at the next request
                    self.last_progress = time.monotonic()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                if self.step_delay:
                    time.sleep(self.step_delay)
                try:
                    outputs = self.engine.step()
                except EngineDead:
                    raise  # below: every request fails, and the server exits
                except StepFailed as e:  # a step that raised must not hang its clients: fail the requests it held
                    log.error("an engine step failed (%s); failing the %d requests it held", e, len(e.request_ids),
                              exc_info=e.__cause__)
                    self._deliver([(rid, EngineError(f"engine step failed: {e}"), True) for rid in e.request_ids])
                    continue
                except Exception as e:  # failed outside the model step: nothing the engine holds can be trusted
                    log.exception("the engine failed between steps; failing the %d requests it held", len(self.engine.requests))
                    self._fail_all(e)
                    continue
                self.last_progress = time.monotonic()
                for out in outputs:
                    if out.finished and self.on_finished is not None:
                        self.on_finished(out)
                self._deliver([(out.request_id, out, out.finished) for out in outputs])
        except BaseException as e:  # the thread itself is failing: nobody may be left waiting
            self.error = e
            log.exception("the engine thread failed; failing every request and refusing new ones")
            self._fail_everything(e)
            if self.on_dead is not None:
                self.on_dead(e)

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for cmd in inbox:
            if cmd[0] == "add":
                _, rid, prompt, params, priority, done, kv_fetch, (tenant, tier) = cmd
                loop = self._queues[rid][0]
                try:
                    self.engine.add_request(rid, prompt, params, priority, kv_fetch=kv_fetch, tenant=tenant, tier=tier)
                except Exception as e:
                    with self._lock:
                        self._queues.pop(rid, None)
                    loop.call_soon_threadsafe(_settle, done, e)
                else:  # admitted: where it stands in the queue
                    loop.call_soon_threadsafe(_settle, done, None, self.engine.queue_estimate(rid))
            elif cmd[0] == "estimate":
                _, rid, loop, answer = cmd
                loop.call_soon_threadsafe(_settle, answer, None, self.engine.queue_estimate(rid))
            else:
                out = self.engine.abort(cmd[1])
                if out is not None:
                    if self.on_finished is not None:
                        self.on_finished(out)
                    self._deliver([(cmd[1], out, True)])

    def _deliver(self, items: list[tuple[str, RequestOutput | EngineError, bool]]) -> None:
        """(request id, output or error, last) items, in order, with one wake-up of each event loop that waits on
        them: a step of 32 sequences would otherwise write to the loop's self-pipe 32 times. After its last item a
        request leaves the table of streams."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for rid, item, last in items:
                entry = self._queues.pop(rid, None) if last else self._queues.get(rid)
                if entry is not None:
                    by_loop.setdefault(entry[0], []).append((rid, entry[1], item))
        for loop, queued in by_loop.items():
            loop.call_soon_threadsafe(self._put_all, queued)

    def _put_all(self, items: list[tuple[str, "StreamQueue", object]]) -> None:
        """On the event loop: each item into its stream's queue, unless that stream's reader has let `max_backlog`
        outputs pile up: then its queue is emptied, it gets an error instead, and its request is aborted."""
        for rid, queue, item in items:
            if queue.cut:
                continue
            if queue.qsize() >= self.max_backlog:
                while not queue.empty():
                    queue.get_nowait()
                queue.cut = True
                queue.put_nowait(EngineError(f"the client read too slowly: {self.max_backlog} outputs were waiting "
                                             "(--max-stream-backlog); the request was aborted"))
                self.num_slow_readers += 1
                if self.on_slow_reader is not None:
                    self.on_slow_reader(rid)
                self.abort(rid)
                continue
            queue.put_nowait(item)

    def _fail_all(self, error: Exception) -> None:
        """Everything the engine holds, and every stream still open (a request the engine let go of before the failure
        was delivered its output, or is failed here: none is left waiting)."""
        failure = EngineError(f"engine step failed: {type(error).__name__}: {error}")
        rids = list(self.engine.requests)
        for rid in rids:
            self.engine.abort(rid)
        with self._lock:  # (not those still in the inbox: they reach the engine next)
            pending = {cmd[1] for cmd in self._inbox if cmd[0] == "add"}
            rids = list(dict.fromkeys(rids + [rid for rid in self._queues if rid not in pending]))
        self._deliver([(rid, failure, True) for rid in rids])

    def _fail_everything(self, error: BaseException) -> None:
        """The engine thread is dying: every stream in flight and every request not yet admitted gets the error."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            queues, self._queues = self._queues, {}
        failure = EngineError(f"the engine stopped after an internal error: {type(error).__name__}: {error}")
        for cmd in inbox:
            if cmd[0] == "add":
                done = cmd[5]
                done.get_loop().call_soon_threadsafe(_settle, done, failure)
        for loop, queue in queues.values():
            loop.call_soon_threadsafe(queue.put_nowait, failure)


class StreamQueue(asyncio.Queue):
    """One request's outputs on their way to its reader; `cut` once the reader fell `max_backlog` behind."""

    cut = False


class RequestStream:
    """The outputs of one admitted request, in order; the last has `finished` set. An engine failure is
    raised from `__anext__`. `aclose()` aborts the request unless it has finished (idempotent)."""

    def __init__(self, aengine: AsyncEngine, request_id: str, queue: asyncio.Queue):
        self._aengine, self.request_id, self._queue = aengine, request_id, queue
        self._done = False
        self.queue_estimate = None  # where it stood when admitted (sieve.queue_eta.QueueEstimate)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._aengine.abort(self.request_id)


def _settle(fut: asyncio.Future, error: Exception | None, result=None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
