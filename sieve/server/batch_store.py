"""The Batch API's state in SQLite (`--batch-dir DIR`: DIR/batches.sqlite): uploaded files, batches, and each batch
request with its result. Every change is one transaction, so a server stopped at any moment restarts with every
request either done (its result stored, never run again) or pending (run again: its earlier run left nothing).
"""

from __future__ import annotations

import json
import re
import secrets
import sqlite3
import threading
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, tenant TEXT, purpose TEXT, filename TEXT, bytes INTEGER,
                                  created_at INTEGER, content BLOB);
CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, tenant TEXT, endpoint TEXT, input_file_id TEXT,
                                    completion_window TEXT, status TEXT, created_at INTEGER, expires_at REAL,
                                    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
                                    cancelling_at INTEGER, cancelled_at INTEGER, expired_at INTEGER,
                                    output_file_id TEXT, error_file_id TEXT, metadata TEXT);
CREATE TABLE IF NOT EXISTS requests (batch_id TEXT, line INTEGER, custom_id TEXT, body TEXT, state TEXT, result TEXT,
                                     PRIMARY KEY (batch_id, line));
"""
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
STREAMING = ("/v1/chat/completions", "/v1/completions")  # the endpoints whose requests a batch runs with stream false
OPEN = ("validating", "in_progress", "cancelling")  # a batch still being worked on
_WINDOW = re.compile(r"^(\d+)(s|m|h)$")


class BatchError(ValueError):
    """A request the Batch API refuses: `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def window_seconds(window: str) -> float:
    """OpenAI's completion_window ("24h"), or any whole number of s, m or h (sieve's: for short jobs and tests)."""
    m = _WINDOW.match(window) if isinstance(window, str) else None
    if m is None or int(m.group(1)) < 1:
        raise BatchError(f"completion_window must be like 24h, 30m or 90s, got {window!r}", "completion_window")
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def parse_lines(content: bytes, endpoint: str) -> tuple[list[tuple[int, str, dict]], list[tuple[int, str | None, str]]]:
    """The input file's requests: (line, custom_id, body) for each good line, (line, custom_id, why) for each bad one
    (a bad line becomes an entry in the error file; the rest run)."""
    good, bad, seen = [], [], set()
    for n, raw in enumerate(content.decode("utf-8", errors="replace").splitlines()):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except json.JSONDecodeError as e:
            bad.append((n, None, f"line {n + 1} is not JSON: {e.msg}"))
            continue
        cid = item.get("custom_id") if isinstance(item, dict) else None
        if not isinstance(item, dict) or not isinstance(cid, str) or not cid:
            bad.append((n, None, f"line {n + 1} has no custom_id string"))
        elif cid in seen:
            bad.append((n, cid, f"line {n + 1}: custom_id {cid!r} is used twice"))
        elif item.get("method") != "POST" or item.get("url") != endpoint:
            bad.append((n, cid, f"line {n + 1}: method must be POST and url {endpoint} (the batch's endpoint)"))
        elif not isinstance(item.get("body"), dict):
            bad.append((n, cid, f"line {n + 1}: body must be an object"))
        elif set(item) - {"custom_id", "method", "url", "body"}:
            bad.append((n, cid, f"line {n + 1}: unknown field {sorted(set(item) - {'custom_id', 'method', 'url', 'body'})[0]!r}"))
        else:
            seen.add(cid)
            good.append((n, cid, item["body"]))
    return good, bad


class BatchStore:
    def __init__(self, directory: str | Path):
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path / "batches.sqlite", check_same_thread=False, isolation_level=None)
        # WAL with synchronous NORMAL: a commit survives the process dying (what a restart mid-batch needs); only a
        # power loss may take the last ones back, whose requests then run again. FULL's fsync per result blocked the
        # server's event loop for every batch request that finished.
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self.lock = threading.Lock()

    def _tx(self, fn):
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                out = fn(self.db)
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
            return out

    # ---- files ---------------------------------------------------------------------------
    def add_file(self, tenant: str, purpose: str, filename: str, content: bytes) -> dict:
        fid = "file-" + secrets.token_hex(12)
        now = int(time.time())
        self._tx(lambda db: db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                                       (fid, tenant, purpose, filename, len(content), now, content)))
        return self.file(tenant, fid)

    def file(self, tenant: str, fid: str) -> dict | None:
        row = self.db.execute("SELECT id, purpose, filename, bytes, created_at FROM files WHERE id = ? AND tenant = ?",
                              (fid, tenant)).fetchone()
        if row is None:
            return None
        return {"id": row[0], "object": "file", "bytes": row[3], "created_at": row[4], "filename": row[2],
                "purpose": row[1], "status": "processed"}

    def file_content(self, tenant: str, fid: str) -> bytes | None:
        row = self.db.execute("SELECT content FROM files WHERE id = ? AND tenant = ?", (fid, tenant)).fetchone()
        return None if row is None else bytes(row[0])

    # ---- batches -------------------------------------------------------------------------
    def create_batch(self, tenant: str, input_file_id: str, endpoint: str, window: str, metadata: dict | None) -> dict:
        if endpoint not in ENDPOINTS:
            raise BatchError(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
        seconds = window_seconds(window)
        content = self.file_content(tenant, input_file_id)
        if content is None:
            raise BatchError(f"no file {input_file_id!r}", "input_file_id")
        if metadata is not None and (not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())):
            raise BatchError("metadata must be an object of strings", "metadata")
        good, bad = parse_lines(content, endpoint)
        bid, now = "batch_" + secrets.token_hex(12), time.time()

        def insert(db):
            db.execute("INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, status, created_at, "
                       "expires_at, in_progress_at, metadata) VALUES (?, ?, ?, ?, ?, 'in_progress', ?, ?, ?, ?)",
                       (bid, tenant, endpoint, input_file_id, window, int(now), now + seconds, int(now),
                        json.dumps(metadata) if metadata is not None else None))
            db.executemany("INSERT INTO requests VALUES (?, ?, ?, ?, 'pending', NULL)",
                           [(bid, n, cid, json.dumps(body)) for n, cid, body in good])
            db.executemany("INSERT INTO requests VALUES (?, ?, ?, NULL, 'failed', ?)",
                           [(bid, n, cid, json.dumps({"error": {"code": "invalid_request", "message": why}}))
                            for n, cid, why in bad])
        self._tx(insert)
        return self.batch(tenant, bid)

    def batch(self, tenant: str | None, bid: str) -> dict | None:
        row = self.db.execute("SELECT * FROM batches WHERE id = ?" + (" AND tenant = ?" if tenant is not None else ""),
                              (bid, tenant) if tenant is not None else (bid,)).fetchone()
        if row is None:
            return None
        cols = [d[0] for d in self.db.execute("SELECT * FROM batches LIMIT 0").description]
        b = dict(zip(cols, row))
        counts = dict(self.db.execute("SELECT state, COUNT(*) FROM requests WHERE batch_id = ? GROUP BY state", (bid,)).fetchall())
        return {"id": b["id"], "object": "batch", "endpoint": b["endpoint"], "errors": None,
                "input_file_id": b["input_file_id"], "completion_window": b["completion_window"], "status": b["status"],
                "output_file_id": b["output_file_id"], "error_file_id": b["error_file_id"], "created_at": b["created_at"],
                "in_progress_at": b["in_progress_at"], "expires_at": int(b["expires_at"]),
                "finalizing_at": b["finalizing_at"], "completed_at": b["completed_at"], "failed_at": None,
                "expired_at": b["expired_at"], "cancelling_at": b["cancelling_at"], "cancelled_at": b["cancelled_at"],
                "request_counts": {"total": sum(counts.values()), "completed": counts.get("done", 0),
                                   "failed": counts.get("failed", 0)},
                "metadata": json.loads(b["metadata"]) if b["metadata"] else None}

    def list_batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        rows = self.db.execute("SELECT id FROM batches WHERE tenant = ? ORDER BY created_at DESC, rowid DESC",
                               (tenant,)).fetchall()
        ids = [r[0] for r in rows]
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        return [self.batch(tenant, i) for i in ids[:limit]], len(ids) > limit

    def cancel(self, tenant: str, bid: str) -> dict | None:
        b = self.batch(tenant, bid)
        if b is None:
            return None
        if b["status"] in OPEN:
            self._tx(lambda db: db.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?",
                                           (int(time.time()), bid)))
        return self.batch(tenant, bid)

    # ---- the runner's side ---------------------------------------------------------------
    def open_batches(self) -> list[tuple[str, str, str, float]]:
        """(id, tenant, status, expires_at) of every batch still being worked on, oldest first."""
        return self.db.execute("SELECT id, tenant, status, expires_at FROM batches WHERE status IN (?, ?, ?) "
                               "ORDER BY created_at, rowid", OPEN).fetchall()

    def pending(self, bid: str, exclude: set, limit: int) -> list[tuple[int, str, dict]]:
        """Up to `limit` pending requests of batch `bid` in line order, those in `exclude` ((batch, line): in flight)
        left out. Only those are read and parsed: the runner asks 20 times a second, and a batch may hold thousands."""
        skip = {n for b, n in exclude if b == bid}
        rows = self.db.execute("SELECT line, custom_id, body FROM requests WHERE batch_id = ? AND state = 'pending' "
                               "ORDER BY line LIMIT ?", (bid, limit + len(skip))).fetchall()
        return [(n, cid, json.loads(body)) for n, cid, body in rows if n not in skip][:limit]

    def endpoint(self, bid: str) -> str:
        return self.db.execute("SELECT endpoint FROM batches WHERE id = ?", (bid,)).fetchone()[0]

    def record(self, bid: str, line: int, ok: bool, result: dict) -> None:
        """A request's result, once: a pending request becomes done (or failed); anything else is left as it is."""
        self._tx(lambda db: db.execute("UPDATE requests SET state = ?, result = ? WHERE batch_id = ? AND line = ? AND "
                                       "state = 'pending'", ("done" if ok else "failed", json.dumps(result), bid, line)))

    def finish(self, bid: str, status: str, reason_code: str | None = None, reason: str | None = None) -> None:
        """Close a batch: pending requests (cancelled or expired) become failed with `reason_code`; its output and
        error files are written from the results, in the input's order."""
        def close(db):
            tenant = db.execute("SELECT tenant FROM batches WHERE id = ?", (bid,)).fetchone()[0]
            if reason_code is not None:
                db.execute("UPDATE requests SET state = 'failed', result = ? WHERE batch_id = ? AND state = 'pending'",
                           (json.dumps({"error": {"code": reason_code, "message": reason}}), bid))
            rows = db.execute("SELECT line, custom_id, state, result FROM requests WHERE batch_id = ? ORDER BY line",
                              (bid,)).fetchall()
            now = int(time.time())
            files = {}
            for state, kind in (("done", "output"), ("failed", "error")):
                lines = [_output_line(bid, n, cid, json.loads(result)) for n, cid, s, result in rows if s == state]
                if lines:
                    fid = "file-" + secrets.token_hex(12)
                    content = ("\n".join(lines) + "\n").encode()
                    db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                               (fid, tenant, "batch_output", f"{bid}_{kind}.jsonl", len(content), now, content))
                    files[kind] = fid
            stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[status]
            db.execute(f"UPDATE batches SET status = ?, finalizing_at = ?, {stamp} = ?, output_file_id = ?, "
                       "error_file_id = ? WHERE id = ?", (status, now, now, files.get("output"), files.get("error"), bid))
        self._tx(close)


def _output_line(bid: str, line: int, custom_id: str | None, result: dict) -> str:
    """OpenAI's batch output line: the response (status code, request id, body), or null and the error."""
    response = result.get("response")
    return json.dumps({"id": f"batch_req_{bid.removeprefix('batch_')}_{line}", "custom_id": custom_id,
                       "response": response, "error": result.get("error")})
