"""The opt-in lossy tier format (`--kv-tier-dtype int8`): each part of a block (the pool's K/V views of it in every
layer, or an MLA layer's latent) stored as int8 codes with a float16 scale per row of its last dimension, per token
and KV head: the int8 KV cache's scheme (sieve/quant/formats.py `quantize_int8_rows`, here in NumPy: see `pack`).
A 16-bit block takes about half its bytes (head_dim 64: 66 bytes a row against 128), a float32 one about a quarter,
so a tier of a given size holds about twice (four times) the blocks. A loaded block is the codes times their scales, each value within half a
step (amax / 254) of the one the pool held: not the pool's bytes, so outputs may differ from recomputing. It is
packed by the tiers' writer thread, off the engine thread, and only over a pool of floats (an 8-bit pool's blocks are
already as small, and go down as they are).
"""

from __future__ import annotations

import numpy as np
import torch

def pack(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parts a lossy block is written as: for each view (a CPU copy), its codes and then its scales.

    NumPy, not torch: this runs on the tiers' writer thread, and torch's operators there start a second OpenMP team
    beside the engine thread's, after which every decode step took twice as long on a 2-core host (SmolLM2: 19 ms
    against 10, measured), even with the writer idle. The same arithmetic as `quantize_int8_rows`, bit for bit
    (tests/test_kv_tiers.py)."""
    out: list[torch.Tensor] = []
    for v in views:
        x = _float32(v)
        s = (np.abs(x).max(axis=-1) / np.float32(127)).clip(min=np.float32(2**-24)).astype(np.float16)
        codes = np.clip(np.round(x / s.astype(np.float32)[..., None]), -127, 127).astype(np.int8)
        out += [torch.from_numpy(codes), torch.from_numpy(s)]
    return out


def _float32(v: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a float32 array, without a torch operator (see `pack`)."""
    if v.dtype == torch.bfloat16:  # bfloat16 is float32's top 16 bits
        return (v.contiguous().view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if v.dtype in (torch.float32, torch.float16):
        return v.contiguous().numpy().astype(np.float32, copy=False)
    raise ValueError(f"the lossy KV tier packs float blocks, not {v.dtype}")


def packed_shapes(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """Empty tensors shaped as `pack(views)`'s parts: what a payload is checked against (sizes)."""
    out: list[torch.Tensor] = []
    for v in views:
        out += [torch.empty(v.shape, dtype=torch.int8), torch.empty(v.shape[:-1], dtype=torch.float16)]
    return out


def unpack_into(views: list[torch.Tensor], raw_parts: list[bytes]) -> None:
    """Write a checked lossy block's parts (codes, scales per view) into the pool's views of one block."""
    for i, dst in enumerate(views):
        codes = torch.frombuffer(bytearray(raw_parts[2 * i]), dtype=torch.int8).reshape(dst.shape)
        scales = torch.frombuffer(bytearray(raw_parts[2 * i + 1]), dtype=torch.float16).reshape(dst.shape[:-1])
        x = codes.float()
        x.mul_(scales.float().unsqueeze(-1))  # in place, and rounded to the pool's dtype by the copy: half the time
        dst.copy_(x)
