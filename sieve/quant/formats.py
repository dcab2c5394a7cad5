"""Weight formats: how a [out, in] matrix is stored in fewer bytes, and how to get it back.

    int8   symmetric, one scale per output channel:      w ≈ q * s[n],              q in [-127, 127]
    fp8    e4m3, one scale per output channel:           w ≈ float(q) * s[n],       |q| <= 448, no subnormals
    int4   asymmetric, groups of `group` inputs:         w ≈ (q - z[n, g]) * s[n, g], q, z in [0, 15]
           (an input size that `group` does not divide gets a shorter last group: q is stored padded)

Scales are float32 here; kernels cast them to what they need. int4 values are stored two per byte
(low nibble first); `values()` unpacks them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class ChannelScaledWeight:
    """int8 or fp8 (e4m3) values with one scale per output channel: w ≈ q * scale[n]."""

    q: torch.Tensor  # [N, K] int8 or float8_e4m3fn
    scale: torch.Tensor  # [N] float32

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale[:, None]).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 2  # scales are kept 16-bit by the kernels


@dataclass
class Int4Weight:
    packed: torch.Tensor  # [N, Kp / 2] uint8, two values 0..15 per byte; Kp = K rounded up to whole groups
    scale: torch.Tensor  # [N, Kp // group] float32
    zero: torch.Tensor  # [N, Kp // group] uint8, integer zero points 0..15
    group: int
    k: int  # the true input size

    @classmethod
    def from_values(cls, q: torch.Tensor, scale, zero, group: int, k: int) -> "Int4Weight":
        return cls(pack_int4_pairs(q), scale, zero, group, k)

    def values(self) -> torch.Tensor:
        """[N, Kp] uint8 values 0..15."""
        p = self.packed
        return torch.stack([p & 0xF, p >> 4], dim=-1).view(p.shape[0], -1)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        q = self.values()
        n, kp = q.shape
        q = q.to(torch.float32).view(n, kp // self.group, self.group)
        w = (q - self.zero.to(torch.float32)[..., None]) * self.scale[..., None]
        return w.view(n, kp)[:, : self.k].to(dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel() * 2 + self.zero.numel() // 2


def quantize_int8(w: torch.Tensor) -> ChannelScaledWeight:
    w = w.to(torch.float32)
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return ChannelScaledWeight(q, scale)


FP8_MIN_NORMAL = 2.0**-6


def quantize_fp8(w: torch.Tensor) -> ChannelScaledWeight:
    """e4m3 without its subnormals: values under the smallest normal 2^-6 round to 0 or ±2^-6 (an error
    of at most 2^-7 steps of the scale, 1/57,344 of the row's largest weight), so that sieve's CPU kernel
    decodes a code with one shift and one mask (sieve/kernels/qmatmul.cpp)."""
    w = w.to(torch.float32)
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    v = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX)
    tiny = v.abs() < FP8_MIN_NORMAL
    v = torch.where(tiny, torch.where(v.abs() >= FP8_MIN_NORMAL / 2, v.sign() * FP8_MIN_NORMAL, 0.0), v)
    return ChannelScaledWeight(v.to(torch.float8_e4m3fn), scale)


def quantize_int4(w: torch.Tensor, group: int = 128) -> Int4Weight:
    """Plain rounding to 16 levels between each group's min and max (the min/max always representable)."""
    n, k = w.shape
    if group < 1:
        raise ValueError(f"int4 group size must be >= 1, got {group}")
    kp = -(-k // group) * group
    w = torch.nn.functional.pad(w.to(torch.float32), (0, kp - k))  # zero padding: the range keeps 0 anyway
    g = w.view(n, kp // group, group)
    lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)  # keep 0 exact, as AWQ does
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15)
    return Int4Weight.from_values(q.view(n, kp).to(torch.uint8), scale, zero.to(torch.uint8), group, k)


def quantize(w: torch.Tensor, method: str, group: int = 128):
    if method == "int8":
        return quantize_int8(w)
    if method == "fp8":
        return quantize_fp8(w)
    if method in ("int4", "awq"):
        return quantize_int4(w, group)
    raise ValueError(f"unknown weight format {method!r}")


def pack_int4_pairs(q: torch.Tensor) -> torch.Tensor:
    """[..., 2m] values 0..15 -> [..., m] bytes (low nibble first)."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)
