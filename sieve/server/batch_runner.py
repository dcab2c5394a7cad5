"""The Batch API's runner: batch requests in the capacity interactive traffic leaves.

A batch request is sent through the server's own routes (in process, with a secret only this process knows), so it
is validated, tokenized and answered exactly as the same request over HTTP, under its tenant. It runs at the lowest
priority there is: a batch request is admitted only while nothing interactive waits, and when blocks run out it is
the first preempted (by recompute: it resumes with its tokens, and its output is what it would be alone). Its result
is stored in SQLite as it finishes (sieve/server/batch_store.py), so a restart runs again only what had not finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from sieve.server.batch_store import STREAMING, BatchStore

log = logging.getLogger("sieve")


class BatchRunner:
    POLL_S = 0.05

    def __init__(self, store: BatchStore, app, engine, aengine, secret: str, max_in_flight: int | None = None):
        self.store, self.app, self.engine, self.aengine, self.secret = store, app, engine, aengine, secret
        self.max_in_flight = max_in_flight or max(1, engine.config.max_num_seqs // 2)
        self.in_flight: dict[tuple[str, int], asyncio.Task] = {}
        self.num_sent = 0

    def idle_slots(self) -> int:
        """Batch requests that may start now: none while an interactive request waits; else the running slots left,
        up to `max_in_flight` batch requests at once."""
        if self.engine.num_waiting or self.aengine.num_pending:
            return 0
        free = self.engine.config.max_num_seqs - len(self.engine.scheduler.running)
        return max(0, min(free, self.max_in_flight - len(self.in_flight)))

    async def run(self) -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://sieve.batch",
                                     timeout=None) as client:
            while True:
                try:
                    self.tick(client, time.time())
                except Exception:  # noqa: BLE001 - a broken tick must not end the runner: logged, tried again
                    log.exception("the batch runner failed a pass; trying again")
                await asyncio.sleep(self.POLL_S)

    def tick(self, client: httpx.AsyncClient, now: float) -> None:
        for bid, tenant, status, expires_at in self.store.open_batches():
            mine = [k for k in self.in_flight if k[0] == bid]
            if status == "cancelling" or now > expires_at:
                for k in mine:  # the engine aborts them as their requests go away
                    self.in_flight.pop(k).cancel()
                if status == "cancelling":
                    self.store.finish(bid, "cancelled", "batch_cancelled", "the batch was cancelled before this request ran")
                else:
                    self.store.finish(bid, "expired", "batch_expired",
                                      "the batch's completion_window ended before this request ran")
                continue
            slots = self.idle_slots()
            todo = self.store.pending(bid, set(self.in_flight), max(slots, 1))
            if not todo and not mine:
                self.store.finish(bid, "completed")
                continue
            for line, custom_id, body in todo[:slots]:
                task = asyncio.ensure_future(self.send(client, bid, tenant, line, body))
                self.in_flight[(bid, line)] = task
                task.add_done_callback(lambda _, k=(bid, line): self.in_flight.pop(k, None))

    async def send(self, client: httpx.AsyncClient, bid: str, tenant: str, line: int, body: dict) -> None:
        endpoint = self.store.endpoint(bid)
        self.num_sent += 1
        try:
            r = await client.post(endpoint, json={**body, "stream": False} if endpoint in STREAMING else body,
                                  headers={"x-sieve-internal": self.secret, "x-sieve-tenant": tenant})
            payload = r.json()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the request fails, its batch goes on
            result, ok = {"error": {"code": "server_error", "message": f"{type(e).__name__}: {e}"}}, False
        else:
            result = {"response": {"status_code": r.status_code, "request_id": payload.get("id", ""), "body": payload}, "error": None}
            ok = r.status_code == 200
        # (on a thread: a commit's disk write must not hold up the event loop, which streams interactive tokens)
        await asyncio.to_thread(self.store.record, bid, line, ok, result)

    async def stop(self, task: asyncio.Task) -> None:
        task.cancel()
        for t in list(self.in_flight.values()):
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
