"""Sustained memory bandwidth (STREAM-style copy and triad) and the decode floor it implies."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass
class Bandwidth:
    copy_gbps: float  # GB/s (1e9), median over repeats
    triad_gbps: float
    read_gbps: float  # read-only: dot product of two arrays (what a decode step does to weights)
    array_mib: int
    threads: int

    @property
    def best_gbps(self) -> float:
        return max(self.copy_gbps, self.triad_gbps)


def measure_bandwidth(device: str = "cpu", array_mib: int = 512, repeats: int = 9) -> Bandwidth:
    """STREAM copy (a = b: 2 arrays moved) and triad (a = b + s*c: 3 arrays), all threads, big arrays;
    also a read-only figure (b . c). The floor uses the best of copy and triad, as the issue defines it."""
    dev = torch.device(device)
    n = array_mib * (1 << 20) // 4
    a, b, c = (torch.full((n,), 0.5, device=dev) for _ in range(3))  # values do not matter; torch.rand took 1 s an array

    def timed(fn) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t

    timed(lambda: a.copy_(b))  # warm-up: page in every array
    timed(lambda: torch.add(b, c, alpha=3.0, out=a))
    copy = statistics.median(timed(lambda: a.copy_(b)) for _ in range(repeats))
    triad = statistics.median(timed(lambda: torch.add(b, c, alpha=3.0, out=a)) for _ in range(repeats))
    read = statistics.median(timed(lambda: torch.dot(b, c)) for _ in range(repeats))
    return Bandwidth(2 * n * 4 / copy / 1e9, 3 * n * 4 / triad / 1e9, 2 * n * 4 / read / 1e9, array_mib, torch.get_num_threads())


def decode_weight_bytes(arch, dtype_bytes: int) -> int:
    """Weight bytes one decode step reads, from the config alone (embedding rows excluded unless tied)."""
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h  # qkv, o, gate/up/down, two norms
    per_layer += (q + 2 * kv) if arch.qkv_bias else 0
    per_layer += 2 * d if arch.qk_norm else 0
    params = arch.num_layers * per_layer + h + arch.vocab_size * h  # final norm + LM head
    return params * dtype_bytes


def report_floor(args, bw: Bandwidth) -> None:
    from sieve.models.arch import ModelArch
    from sieve.models.loader import read_config, resolve_dtype, resolve_model_path

    arch = ModelArch.from_hf_config(read_config(resolve_model_path(args.model)))
    dtype = resolve_dtype(args.dtype, arch)
    weights = decode_weight_bytes(arch, dtype.itemsize)
    kv = arch.kv_bytes_per_token(dtype.itemsize) * args.context
    step = (weights + kv) / (bw.best_gbps * 1e9)
    print(f"{arch.architecture} in {str(dtype).removeprefix('torch.')}: {weights / 1e9:.3f} GB of weights read per step"
          f" + {kv / 1e6:.1f} MB of KV at context {args.context}")
    print(f"decode floor at batch 1: {step * 1e3:.1f} ms per token = {1 / step:.1f} tokens/s (at {bw.best_gbps:.1f} GB/s)")
