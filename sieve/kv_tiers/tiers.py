"""The KV tiers below the pool: blocks written down as they enter the prefix cache, found again when a prompt's
prefix misses the pool, loaded where that beats recomputing them.

Writing (write-through, asynchronous). After each step the engine hands over the blocks its prefix cache took in
(`written`): each one no tier holds yet is copied out of the pool (one memcpy of its bytes on the engine thread) and
queued; a writer thread encodes it (the KV transfer payload: header, parts, a MAC over its bytes and its tokens)
and writes it to every tier. A block is therefore already down when the pool evicts it, and a crash or a restart
loses only what was still queued. A full queue (WRITE_QUEUE_BYTES of copies) drops the write (counted), never
waits: a step is never delayed by a tier.

Reading. `fetch` (any thread: the server calls it before admission, off the engine thread) hashes the prompt's
full blocks (the prefix cache's chained hashes), skips those the pool holds, and takes the run of the next ones a
tier holds, if the cost model says fetching them beats recomputing them. Each block is checked (MAC over its bytes
and the prompt's own tokens, layout, sizes) before anything is kept; the first that fails ends the run, is counted,
logged and deleted, and the rest of the prompt is computed. `admit` (the engine thread) enters the fetched blocks
in the prefix cache, where the scheduler finds them as a hit.

Lossy (opt-in, `lossy`): blocks are written as int8 codes with a scale per token and head (sieve/kv_tiers/lossy.py),
packed by the writer, about half a 16-bit block's bytes; loaded blocks are dequantized into the pool.

Cost model: seconds per block fetched (read, check) and filled into the pool (copied, or dequantized), measured at
start-up on a block of this model and refreshed by every fetch and fill, against seconds per block recomputed (`block_size` x this model's seconds per prefill
token, measured at start-up). A tier slower than recomputing is left alone (counted as `slower`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from sieve.distributed.kv_auth import KVAuth
from sieve.distributed.kv_transfer import KVTransferError, decode_block, encode_block, fill_block
from sieve.kv_tiers import lossy as lossy_format

log = logging.getLogger("sieve")

WRITE_QUEUE_BYTES = 256 << 20  # block copies waiting for the writer; past it a write is dropped (counted), never waited for
EMA = 0.2  # weight of the latest fetch in the measured seconds per block


@dataclass
class TierFetch:
    """Blocks fetched for one prompt, checked, before the engine takes them: `start` is the index of the first
    (those before it were in the pool), `blocks` each one's parts' bytes, `tier` where they came from."""

    start: int = 0
    blocks: list[list[bytes]] = field(default_factory=list)
    tier: str = ""


@dataclass
class TierStats:
    """What /metrics reports (sieve:kv_tier_*): blocks loaded per tier (hits), bytes per tier and direction
    (write, read), seconds per tier and direction, evictions per tier, blocks failing their check, writes that
    failed (a full disk, an unreachable store) or were dropped (queue full), reads that failed, blocks left to recompute
    by reason, and of the hits those loaded for preempted sequences resuming, per tier."""

    hits: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)
    checksum_failures: int = 0
    write_errors: Counter = field(default_factory=Counter)
    read_errors: Counter = field(default_factory=Counter)
    dropped_writes: int = 0
    recomputed: Counter = field(default_factory=Counter)
    resumed: Counter = field(default_factory=Counter)


class KVTiers:
    """The engine's one interface to its tiers (`stores`, fastest first: each with `name`, `knows` (cheap, local),
    `has`, `leading`, `read_many`, `write`, `drop`, `evictions`, `len`). `runner` gives a block's tensors, `blocks`
    (the block manager) its hashes and the prefix cache."""

    def __init__(self, stores: list, auth: KVAuth, layout: str, runner, blocks, lossy: bool = False):
        self.stores, self.auth, self.layout, self.runner, self.blocks = stores, auth, layout, runner, blocks
        # the sliding-window layers' own pool (a hybrid model's), or None: a block goes down with both groups' parts,
        # and comes back into the window pool only where it is inside the window of the prefix loaded
        self.window = getattr(blocks, "window", None)
        self.lossy = lossy  # blocks written as int8 codes and scales (sieve/kv_tiers/lossy.py), not the pool's bytes
        self.block_size = blocks.block_size
        self.stats = TierStats()
        self.fetch_s_per_block = {s.name: 0.0 for s in stores}  # per tier: measured (`calibrate`), refreshed by fetches
        self.recompute_s_per_block = float("inf")  # unknown: fetching always pays
        self.fill_s_per_block = 0.0  # copying a checked block into the pool (a lossy one: dequantizing it), measured
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0  # changed by both threads: under _count_lock
        self._count_lock = threading.Lock()
        self._queued: set[str] = set()
        self._warned: set[str] = set()
        self._writer = threading.Thread(target=self._write_loop, name="sieve-kv-tier-writer", daemon=True)
        self._writer.start()

    # ---- writing (engine thread, then the writer) ------------------------------------------------
    def written(self, new_blocks: list[tuple[bytes, int, list[int]]]) -> None:
        """Blocks the prefix cache took in this step, (chained hash, block, its tokens): queue those no tier holds."""
        for h, block, tokens in new_blocks:
            key = h.hex()
            if key in self._queued or all(s.knows(key) for s in self.stores):
                continue
            wblock = self.window.cached_block(h) if self.window is not None else None
            if self.window is not None and wblock is None:  # its window part already evicted: nothing whole to write
                self.stats.dropped_writes += 1
                continue
            views = self._views(block, wblock)
            size = sum(v.numel() * v.element_size() for v in views)
            with self._count_lock:
                full = self._queued_bytes + size > WRITE_QUEUE_BYTES
                if not full:
                    self._queued_bytes += size
            if full:
                self.stats.dropped_writes += 1
                continue
            self._queued.add(key)
            self._queue.put_nowait((key, tokens, [v.to("cpu", copy=True) for v in views], size))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, tokens, parts, size = item
            try:
                payload = encode_block(self.auth, key, tokens, self.layout, lossy_format.pack(parts) if self.lossy else parts)
                for s in self.stores:
                    started = time.perf_counter()
                    try:
                        if s.has(key):
                            continue
                        s.write(key, payload)
                    except Exception as e:  # noqa: BLE001 (a full disk or a dead store costs the copy, never the server)
                        self.stats.write_errors[s.name] += 1
                        self._warn(s.name + "-write", f"KV tier {s.name}: a block write failed ({type(e).__name__}: {e}); "
                                   "blocks not written are recomputed when asked for")
                        continue
                    self.stats.bytes[(s.name, "write")] += len(payload)
                    self.stats.seconds[(s.name, "write")] += time.perf_counter() - started
            finally:
                self._queued.discard(key)
                with self._count_lock:
                    self._queued_bytes -= size
                self._queue.task_done()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block is written (tests, shutdown). False when `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    # ---- reading -------------------------------------------------------------------------------
    def fetch(self, token_ids: list[int], salt: str | None = None) -> TierFetch:
        """The blocks of `token_ids` after those in the pool that a tier holds, checked (any thread). Never raises for
        a tier's failure: what cannot be used is computed."""
        hashes = self.blocks.prompt_hashes(token_ids[: len(token_ids) - 1], salt)  # never the prompt's last token
        start = 0
        while start < len(hashes) and self.blocks.cached_block(hashes[start]) is not None:
            start += 1
        out = TierFetch(start=start)
        keys = [h.hex() for h in hashes[start:]]
        if not keys:
            return out
        for store in self.stores:  # the first tier that holds the next block gives the run it holds
            try:
                run = store.leading(keys)
            except Exception as e:  # noqa: BLE001 (an unreachable store: the next tier, or the prompt is computed)
                self._read_failed(store, len(keys), e)
                continue
            if run:
                break
        else:
            return out
        if self.fetch_s_per_block[store.name] + self.fill_s_per_block >= self.recompute_s_per_block:
            self.stats.recomputed["slower"] += run
            return out
        out.tier = store.name
        probe = self._probe()
        bs = self.block_size
        started = time.perf_counter()
        try:
            payloads = store.read_many(keys[:run])
        except Exception as e:  # noqa: BLE001
            self._read_failed(store, run, e)
            payloads = []
        for i, payload in enumerate(payloads):
            j = start + i
            if payload is None:  # gone since (evicted)
                self.stats.recomputed["missing"] += run - i
                break
            try:
                parts = decode_block(self.auth, payload, self.layout, token_ids[j * bs : (j + 1) * bs], probe)
            except (KVTransferError, ValueError) as e:
                self.stats.checksum_failures += 1
                self.stats.recomputed["failed check"] += run - i
                log.warning("KV tier %s: block %s failed its check (%s): deleted, and the prompt's rest is computed",
                            store.name, keys[i], e)
                try:
                    store.drop(keys[i])
                except Exception:  # noqa: BLE001 (it is never used either way)
                    pass
                break
            out.blocks.append(parts)
            self.stats.bytes[(store.name, "read")] += len(payload)
        elapsed = time.perf_counter() - started
        self.stats.seconds[(store.name, "read")] += elapsed
        if out.blocks:
            per_block = elapsed / len(out.blocks)
            self.fetch_s_per_block[store.name] += EMA * (per_block - self.fetch_s_per_block[store.name])
        return out

    def _read_failed(self, store, blocks: int, e: Exception) -> None:
        self.stats.recomputed["read failed"] += blocks
        self.stats.read_errors[store.name] += 1
        self._warn(store.name + "-read", f"KV tier {store.name}: a read failed ({type(e).__name__}: {e}); "
                   "the prompt is computed")

    def admit(self, token_ids: list[int], fetched: TierFetch, salt: str | None = None, resumed: bool = False) -> int:
        """The engine thread: enter fetched blocks in the prefix cache. Returns the tokens they cover. `resumed`: for
        a preempted sequence re-entering (counted apart as well)."""
        if not fetched.blocks:
            return 0
        end = fetched.start + len(fetched.blocks)
        hashes = self.blocks.prompt_hashes(token_ids[: end * self.block_size], salt)
        taken = self.blocks.import_cached(hashes[fetched.start : end], keep=hashes[: fetched.start])
        started = time.perf_counter()
        for j, block in taken:
            self._fill(self._views(block, None), fetched.blocks[j])
        if self.window is not None:  # the window group: only the blocks inside the window of the prefix loaded
            first = max(fetched.start, self.window.first_needed_block(end * self.block_size))
            keep = hashes[self.window.first_needed_block(end * self.block_size) : first]
            for j, wblock in self.window.import_cached(hashes[first:end], keep=keep):
                self._fill(self._views(None, wblock), fetched.blocks[first - fetched.start + j], window=True)
        if taken:
            self.fill_s_per_block += EMA * ((time.perf_counter() - started) / len(taken) - self.fill_s_per_block)
        self.stats.hits[fetched.tier] += len(taken)
        if resumed:
            self.stats.resumed[fetched.tier] += len(taken)
        return len(taken) * self.block_size

    # ---- the cost model --------------------------------------------------------------------------
    def calibrate(self, seconds_per_prefill_token: float) -> None:
        """Seconds per block recomputed (this model's prefill) against seconds per block fetched from each tier (a
        block of this layout written, read back and checked, timed) and filled into the pool (into a copy of a block's
        views, timed)."""
        self.recompute_s_per_block = seconds_per_prefill_token * self.block_size
        tokens = [0] * self.block_size
        views = self._views(0, 0 if self.window is not None else None)
        probe = self._probe()
        payload = encode_block(self.auth, "0" * 32, tokens, self.layout, lossy_format.pack(views) if self.lossy else views)
        key = "calibration-" + "0" * 20
        scratch = [v.clone() for v in views]
        raw = decode_block(self.auth, payload, self.layout, tokens, probe)
        times = []
        for _ in range(3):
            started = time.perf_counter()
            self._fill(scratch, raw)
            times.append(time.perf_counter() - started)
        self.fill_s_per_block = sorted(times)[1]
        for store in self.stores:
            try:
                store.write(key, payload)
                times = []
                for _ in range(3):
                    started = time.perf_counter()
                    decode_block(self.auth, store.read_many([key])[0], self.layout, tokens, probe)
                    times.append(time.perf_counter() - started)
                self.fetch_s_per_block[store.name] = sorted(times)[1]
            except Exception as e:  # noqa: BLE001 (a tier that cannot be measured now is still tried, and measured by use)
                log.warning("KV tier %s: could not time a block read (%s: %s)", store.name, type(e).__name__, e)
            finally:
                try:
                    store.drop(key)
                except Exception:  # noqa: BLE001
                    pass
        log.info("KV tiers: %s; a block filled into the pool in %.2f ms, recomputed in %.1f ms", ", ".join(
            f"{s.name} ({len(s)} blocks held, a block fetched in {1e3 * self.fetch_s_per_block[s.name]:.2f} ms)"
            for s in self.stores), 1e3 * self.fill_s_per_block, 1e3 * self.recompute_s_per_block)

    def _views(self, block: int | None, wblock: int | None) -> list:
        """The pool's views of a block as it goes down: the full-attention group's (`block`), then the window group's
        (`wblock`); either None leaves its group out."""
        views = self.runner.block_tensors(block) if block is not None else []
        return views + (self.runner.block_tensors(wblock, group=1) if wblock is not None else [])

    def _fill(self, views: list, raw_parts: list[bytes], window: bool = False) -> None:
        """A checked block's parts into `views`: the full group's parts, or with `window` the window group's."""
        if self.window is not None:
            n = len(self.runner.block_tensors(0)) * (2 if self.lossy else 1)
            raw_parts = raw_parts[n:] if window else raw_parts[:n]
        (lossy_format.unpack_into if self.lossy else fill_block)(views, raw_parts)

    def _probe(self) -> list:
        """Tensors shaped as a block's parts on the wire (what a payload's sizes are checked against)."""
        views = self._views(0, 0 if self.window is not None else None)
        return lossy_format.packed_shapes(views) if self.lossy else views

    def snapshot(self):
        """The counters as /metrics reads them (sieve/stats.py)."""
        from sieve.stats import KVTierStats

        t = self.stats
        return KVTierStats(dict(t.hits), {s.name: len(s) for s in self.stores}, {s.name: s.evictions for s in self.stores},
                           dict(t.bytes), dict(t.seconds), t.checksum_failures, dict(t.write_errors), dict(t.read_errors),
                           t.dropped_writes, dict(t.recomputed), dict(t.resumed), "int8" if self.lossy else "auto")

    def _warn(self, what: str, message: str) -> None:
        """One log line per kind of failure (each is counted in /metrics every time)."""
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)

    def close(self) -> None:
        self.flush(timeout_s=10.0)
        self._queue.put(None)
        self._writer.join(timeout=5.0)
