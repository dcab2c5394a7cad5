"""LoRA adapters under tensor parallelism: every rank holds its shard of each adapter a step runs.

The driver reads and checks an adapter once (sieve/lora/manager.py, with its group), keeps its own shard and the file's
contents as read; the first step that runs the adapter sends those contents to the other ranks (`lora_add`, on the
engine thread, between steps, as every command is), and each shards them for itself as it shards the base weights
(sieve.distributed.shard.shard_lora). Nothing is read from a path on the other ranks. The driver keeps count of what
the ranks hold and drops the least recently used one (`lora_drop`) past `capacity`, never one the step runs.

A step's `AttentionMetadata.lora` (a LoRABatch, holding the adapters themselves) travels as `AdapterRows`: each
adapter's fingerprint and its row spans; a worker rebuilds the LoRABatch from the shards it holds."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections import OrderedDict

import torch

from sieve.lora import LoRABatch
from sieve.lora.adapter import adapter_from


@dataclasses.dataclass(frozen=True)
class AdapterRows:
    """A step's adapters as the driver announces them: (fingerprint, [(first row, end row)]) each."""

    groups: tuple


class DriverAdapters:
    """The driver's count of the adapters the other ranks hold, least recently used first."""

    def __init__(self, capacity: int, weight_dtype: torch.dtype):
        """`capacity`: the adapters the ranks may hold (the engine's max_cpu_loras); `weight_dtype`: the adapters' (as
        the driver's manager keeps them)."""
        self.capacity, self.weight_dtype = capacity, weight_dtype
        self.held: OrderedDict[str, None] = OrderedDict()

    def outgoing(self, group, meta):
        """`meta` as the workers get it: its LoRABatch as AdapterRows, once every adapter in it was sent to them."""
        if meta.lora is None:
            return meta
        return dataclasses.replace(meta, lora=self.rows(group, meta.lora))

    def rows(self, group, batch) -> AdapterRows:
        """`batch` (a LoRABatch) as AdapterRows, once every adapter in it was sent to the ranks."""
        wanted = {adapter.fingerprint for adapter, _ in batch.spans}
        for adapter, _ in batch.spans:
            if adapter.fingerprint in self.held:
                self.held.move_to_end(adapter.fingerprint)
                continue
            if adapter.source is None:
                raise RuntimeError(f"adapter {adapter.name!r} was not read for tensor parallelism")
            while len(self.held) >= self.capacity:
                old = next(fp for fp in self.held if fp not in wanted)
                del self.held[old]
                group.announce(("lora_drop", old))
            config, tensors = adapter.source
            group.announce(("lora_add", adapter.name, adapter.path, adapter.fingerprint, config, tensors, self.weight_dtype))
            self.held[adapter.fingerprint] = None
        return AdapterRows(tuple((adapter.fingerprint, tuple(spans)) for adapter, spans in batch.spans))


class WorkerAdapters:
    """A worker's shards of the adapters the driver sent, by fingerprint."""

    def __init__(self, arch, group, device: torch.device, max_loras: int, max_rank: int):
        """`arch`: the whole model's (adapters are checked against it, then sharded)."""
        self.arch, self.group, self.device, self.max_loras, self.max_rank = arch, group, device, max_loras, max_rank
        self.held: dict[str, object] = {}
        self.slots = None  # CUDA: the step's adapters in slots, as the driver's (sieve/lora/slots.py)

    def add(self, name: str, path: str, fingerprint: str, config: dict, tensors: dict, weight_dtype: torch.dtype) -> None:
        adapter = adapter_from(name, path, config, tensors, self.arch, self.max_rank, weight_dtype, self.device, self.group)
        if adapter.fingerprint != fingerprint:
            raise RuntimeError(f"adapter {name!r} arrived other than the driver read it")
        self.held[fingerprint] = adapter
        if self.slots is None and self.device.type == "cuda" and importlib.util.find_spec("triton") is not None:
            from sieve.distributed.shard import shard_arch
            from sieve.lora.slots import LoRASlots

            shard = shard_arch(self.arch, self.group.world_size)
            self.slots = LoRASlots(shard, self.max_loras, self.max_rank, weight_dtype, self.device)

    def drop(self, fingerprint: str) -> None:
        self.held.pop(fingerprint, None)

    def incoming(self, meta):
        """`meta` with its AdapterRows turned back into a LoRABatch over this rank's shards."""
        if not isinstance(meta.lora, AdapterRows):
            return meta
        return dataclasses.replace(meta, lora=self.batch(meta.lora, self.slots))

    def batch(self, rows: AdapterRows | None, slots=None) -> LoRABatch | None:
        if rows is None:
            return None
        return LoRABatch([(self.held[fp], list(spans)) for fp, spans in rows.groups], self.device, slots)
