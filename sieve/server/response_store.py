"""The Responses API's stored responses, in memory and bounded: each tenant's own, for `GET /v1/responses/{id}`, for
a later turn's `previous_response_id`, and for a background response still running (cancel aborts it)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

from sieve.server.errors import APIError


@dataclass
class Stored:
    tenant: str
    response: dict  # the response object, as GET returns it
    history: list[dict] = field(default_factory=list)  # the conversation's chat messages through its output
    task: asyncio.Task | None = None  # a background response's run, while it runs


class ResponseStore:
    """Up to `max_responses`; past that the oldest finished one is forgotten (a running one is kept)."""

    def __init__(self, max_responses: int = 1000):
        if max_responses < 1:
            raise ValueError("max_responses must be at least 1")
        self.max_responses = max_responses
        self.entries: OrderedDict[str, Stored] = OrderedDict()

    def put(self, entry: Stored) -> None:
        self.entries[entry.response["id"]] = entry
        self.entries.move_to_end(entry.response["id"])
        while len(self.entries) > self.max_responses:
            oldest = next((k for k, e in self.entries.items() if e.task is None or e.task.done()), None)
            if oldest is None:
                break
            del self.entries[oldest]

    def get(self, tenant: str, rid: str, param: str | None = None) -> Stored:
        """A tenant's stored response; a 404 for one that is not stored, was forgotten, or is another tenant's."""
        entry = self.entries.get(rid)
        if entry is None or entry.tenant != tenant:
            raise APIError(404, f"no stored response with id {rid!r} (responses with store false are not kept, and only "
                                f"the last {self.max_responses} are)", param=param, code="response_not_found")
        return entry

    def delete(self, tenant: str, rid: str) -> None:
        entry = self.get(tenant, rid)
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
        del self.entries[rid]
