"""A step's adapters on CUDA: `max_loras` slots of one pool per projection, and one Triton launch per projection for
every adapter's rows (the SGMV idea as Punica and S-LoRA run it).

PyTorch's path runs each adapter's rows as their own pair of matmuls: with 8 adapters on SmolLM2's 30 layers and 4
fused projections that is about 4,000 launches a step, and a GPU step is launch-bound. Here each projection's
products are two launches whatever the adapters: `shrink` (t = x A^T, float32, per row) and `expand` (y += t B^T,
rounded once to y's dtype), each program one row reading its own adapter's matrices from its slot (-1: the base model
alone, untouched).

A pool holds, per projection, [max_loras, layers, in, R] and [max_loras, layers, R, out], R the largest rank a fused
projection may have (max_lora_rank times its shards), zero-padded: a smaller rank, or a projection an adapter leaves
alone, adds zeros. The scheduler never puts more than max_loras adapters in a step, so the step's adapters always fit:
one not resident takes the slot used longest ago by none of them (its matrices copied in once, device to device).
"""

from __future__ import annotations

import functools

import torch

from sieve.layers.attention_triton import next_pow2
from sieve.lora.adapter import LoRAAdapter
from sieve.lora.sites import dense_sites, layer_sites


@functools.lru_cache(maxsize=None)
def _kernels():
    from sieve.lora import triton_kernel

    return triton_kernel



class LoRASlots:
    def __init__(self, arch, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.device = max_loras, device
        layers = arch.num_layers
        self.rank, self.a, self.b = {}, {}, {}
        present = {site for layer in range(layers) for site in layer_sites(arch, layer)}
        for module, (inp, outs) in dense_sites(arch).items():
            if module not in present:  # (latent attention's model has no qkv_proj; its sites run through PyTorch)
                continue
            r = max_rank * len(outs)
            self.rank[module] = r
            self.a[module] = torch.zeros(max_loras, layers, inp, r, dtype=dtype, device=device)
            self.b[module] = torch.zeros(max_loras, layers, r, sum(outs), dtype=dtype, device=device)
        self.resident: list[str | None] = [None] * max_loras  # the fingerprint of the adapter each slot holds
        self.last_step = [0] * max_loras
        self.steps = self.num_loads = 0

    def assign(self, adapters: list[LoRAAdapter]) -> list[int]:
        """A slot for each of a step's adapters (at most max_loras of them), loading those not resident."""
        if len(adapters) > self.max_loras:
            raise ValueError(f"{len(adapters)} adapters in one step, over max_loras {self.max_loras}")
        self.steps += 1
        wanted = {a.fingerprint for a in adapters}
        slots = []
        for adapter in adapters:
            if adapter.fingerprint in self.resident:
                slot = self.resident.index(adapter.fingerprint)
            else:
                free = [i for i, f in enumerate(self.resident) if f not in wanted]
                slot = min(free, key=lambda i: self.last_step[i])
                self._load(slot, adapter)
            self.last_step[slot] = self.steps
            slots.append(slot)
        return slots

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for module in self.a:
            self.a[module][slot].zero_()
            self.b[module][slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            if module not in self.a:  # (a site outside the dense ones runs through PyTorch's matmuls)
                continue
            self.a[module][slot, layer, :, : a.shape[1]].copy_(a)
            self.b[module][slot, layer, : b.shape[0]].copy_(b)
        self.resident[slot] = adapter.fingerprint
        self.num_loads += 1

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor, row_slots: torch.Tensor) -> None:
        """y [T, out] += each row's adapter's (x A^T) B^T for this projection, in place; rows of slot -1 untouched."""
        T, inp = x.shape
        out = y.shape[1]
        if not T:
            return
        a, b, R = self.a[module], self.b[module], self.rank[module]
        RP = next_pow2(R)
        x = x.contiguous()
        t = torch.empty(T, RP, dtype=torch.float32, device=x.device)
        k = _kernels()
        k.shrink[(T,)](x, a, t, row_slots, layer, inp, x.stride(0), a.stride(0), a.stride(1), a.stride(2),
                       R=R, RP=RP, BK=64)
        bn = min(128, next_pow2(out))
        k.expand[(T, -(-out // bn))](t, b, y, row_slots, layer, out, y.stride(0), b.stride(0), b.stride(1), b.stride(2),
                                     R=R, RP=RP, BN=bn)
