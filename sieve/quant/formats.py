"""Weight formats: how a [out, in] matrix is stored in fewer bytes, and how to get it back.

    int8   symmetric, a scale per output channel:        w = q * s[n],                q in [-127, 127]
           or per group of inputs (GGUF Q8_0, 32):      w = q * s[n, g]
    w8a8   int8 per output channel, multiplied against int8 activations quantized per token on every call
           (`acts="int8"`; sieve/quant/w8a8.py): SmoothQuant's and llm-compressor's W8A8
    fp8    e4m3, a scale per output channel:             w = float(q) * s[n],         |q| <= 448, no subnormals
    int4   groups of `group` inputs, a scale and a min:  w = q * s[n, g] + m[n, g],   q in [0, 15]
           (GGUF Q4_1 as stored; zero-point int4 and AWQ are m = -z s, rounded to 16 bits; GGUF Q4_0
           has no min: w = (q - 8) * s, held as such)
           (an input size that `group` does not divide gets a shorter last group: q is stored padded)

Per-channel scales are float32; group scales and mins are float16, as GGUF stores them, so a pass
reads no more bytes than the file holds. `dequantize` computes in float32 exactly as
`gguf.quants.dequantize` does (q * s, or q * s + m), so a GGUF tensor loaded here dequantizes to the
file's values bit for bit. int4 values are stored two per byte (low nibble first); `values()` unpacks
them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class ChannelScaledWeight:
    """int8 or fp8 (e4m3) codes with a scale per output channel ([N] float32) or per group of inputs
    ([N, G] float16: int8 only, G groups of K / G inputs)."""

    q: torch.Tensor  # [N, K] int8 or float8_e4m3fn
    scale: torch.Tensor  # [N] float32, or [N, G] float16
    acts: str | None = None  # "int8": the kernel quantizes its input per token and multiplies integers (W8A8)

    @property
    def group(self) -> int:
        """Inputs per scale (K for a per-channel scale)."""
        return self.q.shape[1] // (self.scale.shape[1] if self.scale.dim() == 2 else 1)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return self.dequantize_rows(None, dtype)

    def dequantize_rows(self, rows: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor:
        """The rows `rows` (all when None) in `dtype`: an embedding lookup reads only these."""
        q, s = (self.q, self.scale) if rows is None else (self.q[rows], self.scale[rows])
        if s.dim() == 1:
            return (q.to(torch.float32) * s[:, None]).to(dtype)
        n = q.shape[0]
        w = q.to(torch.float32).view(n, s.shape[1], -1) * s.to(torch.float32)[..., None]
        return w.view(n, -1).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 2  # per-channel scales are kept 16-bit by the kernels

    @property
    def kind(self) -> str:
        return "fp8" if self.q.dtype == torch.float8_e4m3fn else "int8"

    def describe(self) -> str:
        if self.acts:
            return f"w8a8 ({self.kind} per channel, {self.acts} activations per token)"
        return f"{self.kind} g{self.group}" if self.scale.dim() == 2 else f"{self.kind} per channel"

    def to(self, device) -> "ChannelScaledWeight":
        return ChannelScaledWeight(self.q.to(device), self.scale.to(device), self.acts)

    def like(self, q: torch.Tensor, scale: torch.Tensor) -> "ChannelScaledWeight":
        """Other codes and scales (a slice, a stack) in this weight's format, its activations' included."""
        return ChannelScaledWeight(q, scale, self.acts)


@dataclass
class Int4Weight:
    packed: torch.Tensor  # [N, Kp / 2] uint8, two values 0..15 per byte; Kp = K rounded up to whole groups
    scale: torch.Tensor  # [N, Kp // group] float16
    min: torch.Tensor | None  # [N, Kp // group] float16: the value of code 0; None: -8 * scale (GGUF Q4_0)
    group: int
    k: int  # the true input size

    @classmethod
    def from_values(cls, q: torch.Tensor, scale, min, group: int, k: int) -> "Int4Weight":
        return cls(pack_int4_pairs(q), scale.to(torch.float16), None if min is None else min.to(torch.float16), group, k)

    @classmethod
    def from_zero_points(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, k: int) -> "Int4Weight":
        """w = (q - zero) * scale, held as q * scale + min with both rounded to float16 (AWQ's scales
        already are; min = -zero * scale moves by at most 2^-12 of a group's range)."""
        scale = scale.to(torch.float16)
        return cls.from_values(q, scale, -zero.to(torch.float32) * scale.to(torch.float32), group, k)

    @property
    def zero(self) -> torch.Tensor:
        """Integer zero points (for the AutoAWQ layout): the code whose value is closest to 0."""
        if self.min is None:
            return torch.full(self.scale.shape, 8, dtype=torch.uint8)
        return torch.round(-self.min.float() / self.scale.float()).clamp(0, 15).to(torch.uint8)

    def values(self) -> torch.Tensor:
        """[N, Kp] uint8 values 0..15."""
        p = self.packed
        return torch.stack([p & 0xF, p >> 4], dim=-1).view(p.shape[0], -1)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return self.dequantize_rows(None, dtype)

    def dequantize_rows(self, rows: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor:
        q = self.values() if rows is None else Int4Weight(self.packed[rows], self.scale, None, self.group, self.k).values()
        s = self.scale if rows is None else self.scale[rows]
        n, kp = q.shape
        q = q.to(torch.float32).view(n, kp // self.group, self.group)
        if self.min is None:  # as gguf computes Q4_0: d * (q - 8)
            w = s.to(torch.float32)[..., None] * (q - 8)
        else:
            m = self.min if rows is None else self.min[rows]
            w = q * s.to(torch.float32)[..., None] + m.to(torch.float32)[..., None]
        return w.view(n, kp)[:, : self.k].to(dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel() * 2 + (0 if self.min is None else self.min.numel() * 2)

    kind = "int4"

    def describe(self) -> str:
        return f"int4 g{self.group}" + (" symmetric" if self.min is None else "")

    def to(self, device) -> "Int4Weight":
        return Int4Weight(self.packed.to(device), self.scale.to(device), None if self.min is None else self.min.to(device),
                          self.group, self.k)


def quantize_int8(w: torch.Tensor) -> ChannelScaledWeight:
    w = w.to(torch.float32)
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return ChannelScaledWeight(q, scale)


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ~ codes * scales[..., None]: int8 codes, and a float16 scale per row of the last dimension (amax / 127, as
    stored: the codes are computed against the float16 value read back). The int8 KV cache's scheme (a scale per token
    and KV head), and the lossy KV tier's."""
    s = (x.float().abs().amax(dim=-1) / 127).clamp(min=2**-24).to(torch.float16)  # float16's least step: never 0
    return torch.round(x.float() / s.float()[..., None]).clamp(-127, 127).to(torch.int8), s


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
    """Plain rounding to 16 levels between each group's min and max (0 always representable, as AWQ
    keeps it), with a float16 scale and an integer zero point (held as a float16 min)."""
    n, k = w.shape
    if group < 1:
        raise ValueError(f"int4 group size must be >= 1, got {group}")
    kp = -(-k // group) * group
    w = torch.nn.functional.pad(w.to(torch.float32), (0, kp - k))  # zero padding: the range keeps 0 anyway
    g = w.view(n, kp // group, group)
    lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).to(torch.float16).to(torch.float32)  # 1e-6: a normal float16
    zero = torch.round(-lo / scale).clamp(0, 15)
    min_ = (-zero * scale).to(torch.float16).to(torch.float32)
    q = torch.round((g - min_[..., None]) / scale[..., None]).clamp(0, 15)
    return Int4Weight.from_values(q.view(n, kp).to(torch.uint8), scale, min_, group, k)


def quantize(w: torch.Tensor, method: str, group: int = 128):
    if method == "int8":
        return quantize_int8(w)
    if method == "w8a8":
        return dataclasses.replace(quantize_int8(w), acts="int8")
    if method == "fp8":
        return quantize_fp8(w)
    if method in ("int4", "awq"):
        return quantize_int4(w, group)
    raise ValueError(f"unknown weight format {method!r}")


def concat_rows(parts: list) -> ChannelScaledWeight | Int4Weight:
    """Stack weights of one format along the output dimension (q | k | v, gate | up)."""
    a = parts[0]
    if isinstance(a, ChannelScaledWeight):
        return a.like(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    mins = None if a.min is None else torch.cat([p.min for p in parts])
    return Int4Weight(torch.cat([p.packed for p in parts]), torch.cat([p.scale for p in parts]), mins, a.group, a.k)


def same_layout(parts: list) -> bool:
    """Whether `concat_rows` can stack these: one format, one group size, one input size."""
    a = parts[0]
    if isinstance(a, ChannelScaledWeight):
        return all(isinstance(p, ChannelScaledWeight) and p.q.dtype == a.q.dtype and p.q.shape[1] == a.q.shape[1]
                   and p.scale.dim() == a.scale.dim() and p.group == a.group and p.acts == a.acts for p in parts)
    return all(isinstance(p, Int4Weight) and p.group == a.group and p.k == a.k and (p.min is None) == (a.min is None) for p in parts)


def pack_int4_pairs(q: torch.Tensor) -> torch.Tensor:
    """[..., 2m] values 0..15 -> [..., m] bytes (low nibble first)."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)


def narrow_rows(w, start: int, length: int):
    """Output rows start..start+length of a quantized weight (a tensor-parallel shard of a column-parallel layer)."""
    if isinstance(w, ChannelScaledWeight):
        return w.like(w.q[start : start + length].contiguous(), w.scale[start : start + length].contiguous())
    mins = None if w.min is None else w.min[start : start + length].contiguous()
    return Int4Weight(w.packed[start : start + length].contiguous(), w.scale[start : start + length].contiguous(), mins, w.group, w.k)


def narrow_cols(w, start: int, length: int):
    """Inputs start..start+length of a quantized weight (a shard of a row-parallel layer): exact only where the cut
    falls on group boundaries, which is checked; a per-channel scale covers every input and is kept whole."""
    per_channel = isinstance(w, ChannelScaledWeight) and w.scale.dim() == 1
    group = w.group
    if not per_channel and (start % group or length % group):
        raise ValueError(f"a {w.describe()} weight cannot be split at inputs {start}..{start + length}: "
                         f"the cut must fall on its groups of {group}")
    if isinstance(w, ChannelScaledWeight):
        scale = w.scale if per_channel else w.scale[:, start // group : (start + length) // group]
        return w.like(w.q[:, start : start + length].contiguous(), scale.contiguous())
    g0, g1 = start // group, (start + length) // group
    mins = None if w.min is None else w.min[:, g0:g1].contiguous()
    return Int4Weight(w.packed[:, start // 2 : (start + length) // 2].contiguous(), w.scale[:, g0:g1].contiguous(), mins, group, length)
