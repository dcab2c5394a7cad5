"""Rotary position embeddings (non-interleaved, as in Hugging Face Llama), with rope scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from sieve.kernels import cpu_ops


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with the checkpoint's rope scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":  # GGUF's form of Llama 3.1 scaling (rope_freqs): a divisor per frequency
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, GGUF rope_freqs)")


@dataclass
class RopeStep:
    """What one step's tokens need to rotate their queries and keys."""

    positions: torch.Tensor  # [T] int64
    cos_table: torch.Tensor  # [P, D/2] float32, the whole table
    sin_table: torch.Tensor
    cos: torch.Tensor | None = None  # [T, 1, D] cos | cos in the model dtype (PyTorch path)
    signed_sin: torch.Tensor | None = None  # [T, 1, D] -sin | sin

    def gathered(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos | cos, -sin | sin) [T, 1, D] of these tokens in `dtype` (as the reference casts them)."""
        cos, sin = self.cos_table[self.positions].to(dtype), self.sin_table[self.positions].to(dtype)
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin tables; `forward` prepares them once per step for all layers."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def mean_rotation(self, first: int, count: int) -> torch.Tensor:
        """[D, D] float32: the rotation of positions first .. first + count - 1, averaged (R q is q rotated at one
        position, in the rotate-half form; computed from the frequencies, so past the tables' positions too)."""
        freqs = torch.outer(torch.arange(first, first + count, dtype=torch.float32, device=self.inv_freq.device),
                            self.inv_freq.float())  # [count, D/2]
        cos, sin = freqs.cos().mean(0), freqs.sin().mean(0)
        half = cos.numel()
        eye = torch.eye(half, device=cos.device)
        # x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (linear in cos and sin, so the mean is the mean's rotation)
        return torch.cat([torch.cat([eye * cos, -eye * sin], dim=1), torch.cat([eye * sin, eye * cos], dim=1)], dim=0)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeStep:
        step = RopeStep(positions, self.cos, self.sin)
        if not _native(dtype, positions.device):  # gather per token, in `dtype`
            step.cos, step.signed_sin = step.gathered(dtype)
        return step


def apply_rotary(x: torch.Tensor, rope: RopeStep) -> torch.Tensor:
    """x [T, heads, D] -> rotated (rotate-half convention): [x1 cos - x2 sin, x2 cos + x1 sin].
    bf16 and float32 on CPU: in place, by one native kernel that rounds as the reference does. Otherwise a copy:
    `roll` swaps the halves and the sign lives in the table, 4 ops instead of 8, with the same
    floating-point result (a - b == a + (-b))."""
    if rope.cos is None and not x.requires_grad:  # (the native kernel records no gradient)
        cpu_ops().rotary_(x, rope.positions, rope.cos_table, rope.sin_table)
        return x
    # (a tensor that requires grad, where the step prepared for the native kernel, gathers the tables here)
    cos, signed_sin = (rope.cos, rope.signed_sin) if rope.cos is not None else rope.gathered(x.dtype)
    return rotate_half_form(x, cos, signed_sin)


def rotate_half_form(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated by (cos | cos) and (-sin | sin) [..., D]: x cos + (x's halves swapped) signed sin."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _native(dtype: torch.dtype, device: torch.device) -> bool:
    # float32 too: the C++ layer loop's arithmetic (a contracted FMA where PyTorch multiplies and adds), so that the
    # Python loop gives its bits
    return dtype in (torch.bfloat16, torch.float32) and device.type == "cpu" and cpu_ops() is not None
