"""A Batch API job beside an interactive load (`sieve bench serve --batch-requests N`): N chat requests uploaded as a
JSONL file (`POST /v1/files`, purpose batch) and submitted (`POST /v1/batches`) as the load starts; when the load
ends, how many the server finished meanwhile, and (with `--batch-wait`) when the whole batch completed.

The interactive figures of the same command without `--batch-requests` are the reference: the issue's target is the
interactive p99s within 10% of them (docs/benchmarks.md#scarcity-scheduling)."""

from __future__ import annotations

import json
import random
import time

import httpx

WORDS = ("river garden music number house market winter letter doctor station window silver forest engine teacher "
         "harbor village summer bridge mountain kitchen student library island morning painter theatre planet").split()


def batch_lines(model: str, n: int, output_len: int, seed: int = 0, words: int = 60) -> bytes:
    """N chat requests in the Batch API's JSONL: a short instruction over `words` random words each."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        body = {"model": model, "max_tokens": output_len, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Write one sentence about these words: {text}"}]}
        lines.append(json.dumps({"custom_id": f"bg-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    return ("\n".join(lines) + "\n").encode()


class BackgroundBatch:
    def __init__(self, base_url: str, model: str, api_key: str | None, n: int, output_len: int, seed: int = 0):
        self.base = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model, self.n, self.output_len, self.seed = model, n, output_len, seed
        self.id: str | None = None
        self.started = 0.0

    def submit(self) -> None:
        content = batch_lines(self.model, self.n, self.output_len, self.seed)
        with httpx.Client(headers=self.headers, timeout=120) as c:
            f = c.post(self.base + "/files", files={"file": ("background.jsonl", content)}, data={"purpose": "batch"})
            f.raise_for_status()
            self.started = time.perf_counter()
            b = c.post(self.base + "/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions",
                                                      "completion_window": "24h"})
            b.raise_for_status()
            self.id = b.json()["id"]

    def status(self) -> dict:
        with httpx.Client(headers=self.headers, timeout=60) as c:
            r = c.get(f"{self.base}/batches/{self.id}")
            r.raise_for_status()
            return r.json()

    def report(self, wait: bool, timeout_s: float = 3600.0, poll_s: float = 1.0) -> dict:
        """What the batch did while the load ran; with `wait`, also when it completed (or the timeout)."""
        now = self.status()
        during = time.perf_counter() - self.started
        done = now["request_counts"]["completed"]
        out = {"requests": self.n, "output_len": self.output_len, "batch_id": self.id,
               "during_load": {"seconds": round(during, 1), "completed": done, "requests_per_s": round(done / during, 3)}}
        while wait and now["status"] not in ("completed", "failed", "expired", "cancelled") \
                and time.perf_counter() - self.started < timeout_s:
            time.sleep(poll_s)
            now = self.status()
        if wait:
            total = time.perf_counter() - self.started
            counts = now["request_counts"]
            out.update(status=now["status"], seconds=round(total, 1), completed=counts["completed"], failed=counts["failed"],
                       requests_per_s=round(counts["completed"] / total, 3),
                       output_tokens_per_s=round(counts["completed"] * self.output_len / total, 1))
        return out
