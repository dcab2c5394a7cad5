"""The adapters an engine serves: registered by name (with their folder), up to `max_cpu_loras` of them loaded in
memory (the least recently used one is dropped past that, and read again from its folder when next asked for), and up
to `max_loras` of them in one step (the scheduler holds back a request whose adapter would be one too many).

Reading an adapter is the slow part (a file read and a check); `load` does it on the caller's thread, which the
server keeps off the engine thread (its tokenizer pool), and `register`/`unregister` only swap dictionary entries
under a lock. An adapter unregistered while requests use it stays with them until they finish; new requests can no
longer name it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from sieve.lora.adapter import LoRAAdapter, LoRAError, load_adapter


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: a request's adapter, by name, id and folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class LoRAManager:
    def __init__(self, arch, dtype: torch.dtype, device: torch.device, max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None, tp=None):
        """`tp`: the tensor-parallel group (`arch` is then the whole model's): adapters are kept as this rank's shard."""
        self.arch, self.dtype, self.device, self.tp = arch, dtype, device, tp
        self.max_loras, self.max_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.paths: dict[str, str] = {}  # registered: name -> folder
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # in memory, least recently used first
        self.lock = threading.Lock()
        self.num_loads = 0

    @property
    def names(self) -> list[str]:
        with self.lock:
            return list(self.paths)

    def read(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter (LoRAError naming what is wrong); nothing is registered."""
        if not name or not isinstance(name, str):
            raise LoRAError("an adapter needs a name")
        adapter = load_adapter(name, path, self.arch, self.max_rank, self.dtype, self.device, self.tp)
        self.num_loads += 1
        return adapter

    def register(self, adapter: LoRAAdapter, replace: bool = False) -> None:
        with self.lock:
            if adapter.name in self.paths and not replace:
                raise LoRAError(f"an adapter named {adapter.name!r} is already loaded (unload it first)")
            self.paths[adapter.name] = adapter.path
            self._keep(adapter)

    def load(self, name: str, path: str, replace: bool = False) -> LoRAAdapter:
        adapter = self.read(name, path)
        self.register(adapter, replace)
        return adapter

    def unregister(self, name: str) -> None:
        with self.lock:
            if name not in self.paths:
                raise LoRAError(f"no adapter named {name!r} is loaded")
            del self.paths[name]
            self.loaded.pop(name, None)

    def _keep(self, adapter: LoRAAdapter) -> None:
        self.loaded[adapter.name] = adapter
        self.loaded.move_to_end(adapter.name)
        while len(self.loaded) > self.max_cpu_loras:
            self.loaded.popitem(last=False)

    def get(self, name: str) -> LoRAAdapter:
        """A registered adapter, read again from its folder if it was dropped from memory (LoRAError if not
        registered)."""
        with self.lock:
            if name not in self.paths:
                raise LoRAError(f"no adapter named {name!r} is loaded")
            adapter = self.loaded.get(name)
            if adapter is not None:
                self.loaded.move_to_end(name)
                return adapter
            path = self.paths[name]
        adapter = self.read(name, path)
        with self.lock:
            if self.paths.get(name) == path:
                self._keep(adapter)
        return adapter

    def resolve(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter a request names: a registered one by name, or (the offline API) one registered now from the
        request's folder."""
        with self.lock:
            known = request.lora_name in self.paths
        if not known and not request.lora_path:  # (the server names registered adapters only, with no path of their own)
            raise LoRAError(f"no adapter named {request.lora_name!r} is loaded")
        if not known:
            return self.load(request.lora_name, request.lora_path)
        return self.get(request.lora_name)
