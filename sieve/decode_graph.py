"""A decode step that can be captured in a CUDA graph: static buffers, batch-size buckets, padded rows.

On a GPU a small model's decode step is launch-bound: the Python layer loop launches each small kernel in turn
(SmolLM2-135M: 12-20 ms a step on an H200, whose bandwidth reads its weights in 0.02 ms). A CUDA graph replays
the kernels of one captured step with no Python between them, on the addresses it captured them with. So a step
that is to be captured reads everything from buffers allocated once:
  - token ids, positions, the slot each row's K/V is written to, block tables and context lengths live in one
    flat int64 device buffer, filled from one host buffer by one copy a step (`StaticDecode.run`);
  - a step of n rows runs as the smallest bucket b >= n (`capture_sizes`: 1, 2, 4, 8, 16, 24, 32, 48, 64, ...,
    vLLM's `cudagraph_capture_sizes`), one graph per bucket. Rows n .. b - 1 are padding: token 0 at position 0,
    whose K/V goes to slot 0 of the pad block (a block of the pool the block manager never hands out) and which
    attends to that one key. So a padded row writes nowhere that matters, and reads nothing a real row wrote;
  - block tables are as wide as the longest context; the attention kernels (CPU and Triton) read a row's blocks up
    to its own length, so what lies past it in the table is never read.
Speculative verification rows (1 + k per sequence, and a draft tree's chains) are decode rows of their sequence's
table, so they fall into the same buckets. A step with prefill chunks, LoRA adapters, EAGLE-3's inner-layer
features or more rows than the largest bucket runs eagerly, as before. Sampling follows the captured forward on
the device, eagerly (a few launches, after which the step's tokens are read anyway).

Nothing inside the step may synchronise with the host or build a tensor from host data: captured, it would
replay a stale value. `StepGuard` asserts it for whatever runs under it (`aten._local_scalar_dense`: `.item()`,
`bool(t)`; `lift_fresh`: `torch.tensor(list)`; `.tolist()`; data-dependent shapes: `nonzero`, boolean indexing).

On the CPU the same path runs eagerly through the same buffers (`EngineConfig.static_decode_on_cpu`; the native
layer loop reads them like any metadata), which is how the CPU suite tests it (tests/test_decode_graph.py): a
padded step equals an unpadded one, padded rows leave the cache untouched, nothing in the step syncs. By default
the CPU takes the unpadded eager step, which does no work for padding.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sieve.layers.attention import AttentionMetadata

log = logging.getLogger("sieve")

# What a captured step may not do: read a value back to the host, build a tensor from host data, or take a shape
# from the data
_FORBIDDEN = {"_local_scalar_dense", "lift_fresh", "lift_fresh_copy", "nonzero", "masked_select", "_unique2",
              "unique_dim", "unique_consecutive", "repeat_interleave"}


def capture_sizes(max_rows: int, sizes: list[int] | tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The batch-size buckets, ascending: `sizes` where given (checked), else 1, 2, 4, 8, then every 8 up to 32 and
    every 16 past it, the last the first that holds `max_rows`."""
    if sizes:
        bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1]
        if bad:
            raise ValueError(f"cuda_graph_sizes must be positive integers, got {bad[0]!r}")
        return tuple(sorted(set(sizes)))
    out = [1]
    while out[-1] < max_rows:
        out.append(out[-1] * 2 if out[-1] < 8 else out[-1] + (8 if out[-1] < 32 else 16))
    return tuple(out)


class GraphBreak(RuntimeError):
    """A step meant to be captured did something a CUDA graph cannot replay."""


class StepGuard(TorchDispatchMode):
    """Raises GraphBreak at any operation a captured step may not do (the module docstring lists them). `.tolist()`
    bypasses the dispatcher: it is patched to raise while the guard is on."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in _FORBIDDEN:
            raise GraphBreak(f"{func} inside a step meant to be captured (a host sync or host data)")
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
            raise GraphBreak("boolean indexing inside a step meant to be captured (a shape taken from the data)")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = original = torch.Tensor.tolist
        owner = threading.get_ident()

        def tolist(t):  # (only on the guarded thread: a server's other threads go on as before)
            if threading.get_ident() == owner:
                raise GraphBreak(".tolist() inside a step meant to be captured (a host sync)")
            return original(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


class StaticDecode:
    """Decode-only steps through static buffers, padded to buckets; captured in CUDA graphs where `capture` runs.

    `forward(input_ids, positions, meta)` is the model's forward (it must read nothing but these); `pad_slot` is
    slot 0 of the pad block; `max_blocks` the widest block table a row may have."""

    def __init__(self, forward, device: torch.device, sizes: tuple[int, ...], max_blocks: int, pad_block: int, block_size: int):
        self.forward, self.device, self.sizes, self.block_size = forward, device, sizes, block_size
        self.max_rows, self.max_blocks, self.pad_block = sizes[-1], max_blocks, pad_block
        n, w = self.max_rows, max_blocks
        cuda = device.type == "cuda"
        # one host buffer, one device buffer (on the CPU the same one): ids | positions | slots | lengths | tables
        self._host = torch.zeros(n * (4 + w), dtype=torch.int64, pin_memory=cuda)
        self._dev = torch.zeros_like(self._host, device=device) if cuda else self._host
        self._pad_host()
        if cuda:
            self._dev.copy_(self._host)
        self.host_views, self.views = self._split(self._host), self._split(self._dev)
        ids, positions, slots, lens, tables = self.views
        self.metas = {b: AttentionMetadata(slots[:b], b, tables[:b], lens[:b], []) for b in sizes}
        self.graphs: dict[int, object] = {}  # bucket -> torch.cuda.CUDAGraph
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> the hidden states its graph writes
        self.steps = self.padded_rows = 0  # decode steps run here, and the padding rows they ran

    def _split(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = self.max_rows
        ids, positions, slots, lens, tables = flat.split([n, n, n, n, n * self.max_blocks])
        return ids, positions, slots, lens, tables.view(n, self.max_blocks)

    def _pad_host(self, first: int = 0) -> None:
        """Rows first .. max_rows - 1 of the host buffer as padding: token 0 at position 0, writing and reading slot 0 of
        the pad block."""
        ids, positions, slots, lens, tables = self._split(self._host)
        ids[first:] = 0
        positions[first:] = 0
        slots[first:] = self.pad_block * self.block_size
        lens[first:] = 1
        tables[first:, 0] = self.pad_block

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding `rows`, or None (more rows than the largest)."""
        for b in self.sizes:
            if b >= rows:
                return b
        return None

    def fits(self, rows: int, widest: int) -> bool:
        return 0 < rows <= self.max_rows and widest <= self.max_blocks

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            lens: list[int]) -> torch.Tensor:
        """Hidden states [n, hidden] of n decode rows (`fits` them): row i is token input_ids[i] at positions[i],
        its K/V written to slots[i], attending to the first lens[i] keys of tables[i]. The returned tensor is the
        graph's output where one replayed: read it before the next step."""
        n = len(input_ids)
        b = self.bucket(n)
        h_ids, h_pos, h_slots, h_lens, h_tables = self.host_views
        h_ids[:n] = torch.tensor(input_ids, dtype=torch.int64)
        h_pos[:n] = torch.tensor(positions, dtype=torch.int64)
        h_slots[:n] = torch.tensor(slots, dtype=torch.int64)
        h_lens[:n] = torch.tensor(lens, dtype=torch.int64)
        done: dict[int, int] = {}  # a sequence's rows (a decode and its drafts) share one table: copied once
        for i, t in enumerate(tables):
            j = done.setdefault(id(t), i)
            if j == i:
                h_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
            else:
                h_tables[i, : len(t)] = h_tables[j, : len(t)]
        self._pad_host(n)
        if self._dev is not self._host:
            used = self.max_rows * 4 + b * self.max_blocks  # the tables of rows past the bucket are never read
            self._dev[: self.max_rows * 4].copy_(self._host[: self.max_rows * 4], non_blocking=True)
            self._dev[self.max_rows * 4: used].copy_(self._host[self.max_rows * 4: used], non_blocking=True)
        self.steps += 1
        self.padded_rows += b - n
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
            return self.outputs[b][:n]
        return self.step(b)[:n]

    def step(self, b: int) -> torch.Tensor:
        """The forward of bucket b over the buffers as they stand."""
        ids, positions = self.views[0], self.views[1]
        return self.forward(ids[:b], positions[:b], self.metas[b])

    def capture(self) -> None:
        """One CUDA graph per bucket, largest first (the smaller ones reuse its memory pool), over padding rows; timed
        and logged, with the memory the graphs' pool took."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs are captured on a CUDA device")
        self._pad_host()
        self._dev.copy_(self._host)
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for b in reversed(self.sizes):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton's compilation and cuBLAS's workspaces happen outside the graph
                    self.step(b)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), StepGuard():
                self.outputs[b] = self.step(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        took = time.perf_counter() - started
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        log.info("CUDA graphs: %d decode buckets captured (%s rows) in %.1f s; their memory pool took %.1f MiB",
                 len(self.sizes), ", ".join(map(str, self.sizes)), took, used / 2**20)

