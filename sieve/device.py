"""Which device to run on, and how much memory it has free."""

from __future__ import annotations

import math
import mmap

import torch


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor for a large pool (the KV cache). On the CPU its memory is an anonymous map: the
    kernel hands out zeroed pages as they are first written, so a pool of gigabytes is ready at once and
    holds memory as its blocks are used. torch.zeros writes every page before the engine starts: 6-12 s
    for the default 6.6 GB pool on a 2-core host, where the page faults run at about 1 GB/s."""
    numel = math.prod(shape)
    if device.type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, numel * dtype.itemsize)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)  # the tensor keeps `buf` alive
