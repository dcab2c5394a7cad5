"""Matmul kernels for quantized weights, one class per format, all called as `kernel(x, bias)`.

Which kernel runs depends on the batch (rows of x) and the device, from measurements on the
development machine (docs/benchmarks.md, "Quantized weights"):
  - CPU, few rows: PyTorch's packed kernels read the small format directly
    (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`); fp8 has none, so it dequantizes.
  - CPU, many rows: those kernels fall far behind a bf16 GEMM (int8pack ~7x slower at 32 rows), so
    the weight is dequantized into the activation dtype for one ordinary GEMM.
  - CUDA: dequantize + GEMM (FP8 matmul `_scaled_mm` where the device has FP8 tensor cores).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sieve.quant.formats import Fp8Weight, Int4Weight, Int8Weight

SMALL_ROWS = {"int8": 8, "int4": 8}  # up to this many rows the packed CPU kernel wins (measured)


class DequantKernel:
    """Dequantize into the activation dtype, then one GEMM. Works for every format and device."""

    def __init__(self, w, dtype: torch.dtype):
        self.w, self.dtype = w, dtype

    def dense(self) -> torch.Tensor:
        return self.w.dequantize(self.dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [T, K] -> [T, N]
        return F.linear(x, self.dense(), bias)


class Int8Kernel(DequantKernel):
    def __init__(self, w: Int8Weight, dtype: torch.dtype):
        super().__init__(w, dtype)
        self.cpu_small = w.q.device.type == "cpu"
        self.scale = w.scale.to(dtype)

    def __call__(self, x, bias):
        if self.cpu_small and x.shape[0] <= SMALL_ROWS["int8"]:
            y = torch._weight_int8pack_mm(x.contiguous(), self.w.q, self.scale)
            return y if bias is None else y + bias
        return F.linear(x, self.w.q.to(self.dtype) * self.scale[:, None], bias)


class Int4Kernel(DequantKernel):
    def __init__(self, w: Int4Weight, dtype: torch.dtype):
        super().__init__(w, dtype)
        self.packed = None
        fits = w.k == w.q.shape[1] and w.k % 32 == 0 and w.q.shape[0] % 16 == 0  # the packed kernel's tiles
        if fits and w.q.device.type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu"):
            # PyTorch's CPU int4 layout: w = (q - 8) * scale + zero_float, per [group, out] pair
            self.packed = torch._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1)
            zero_float = (8 - w.zero.to(torch.float32)) * w.scale
            self.scales_and_zeros = torch.stack([w.scale, zero_float], dim=-1).transpose(0, 1).contiguous().to(dtype)

    def __call__(self, x, bias):
        if self.packed is not None and x.shape[0] <= SMALL_ROWS["int4"] and x.dtype == self.dtype:
            y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.w.group, self.scales_and_zeros)
            return y if bias is None else y + bias
        return F.linear(x, self.dense(), bias)


class Fp8Kernel(DequantKernel):
    def __init__(self, w: Fp8Weight, dtype: torch.dtype):
        super().__init__(w, dtype)
        self.scale = w.scale.to(dtype)
        dev = w.q.device
        self.native = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9)
        if self.native:
            self.qt = w.q.t()  # column-major for _scaled_mm
            self.scale_b = w.scale.to(torch.float32)[None, :]

    def __call__(self, x, bias):
        if self.native:  # W8A8 with a per-row activation scale
            a_scale = (x.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp(min=1e-12)
            xq = (x / a_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            return torch._scaled_mm(xq, self.qt, scale_a=a_scale, scale_b=self.scale_b, bias=bias, out_dtype=x.dtype)
        return F.linear(x, self.w.q.to(self.dtype) * self.scale[:, None], bias)


def make_kernel(w, dtype: torch.dtype):
    if isinstance(w, Int8Weight):
        return Int8Kernel(w, dtype)
    if isinstance(w, Int4Weight):
        return Int4Kernel(w, dtype)
    if isinstance(w, Fp8Weight):
        return Fp8Kernel(w, dtype)
    raise TypeError(f"no kernel for {type(w).__name__}")
