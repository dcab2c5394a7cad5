"""Matmul kernels for quantized weights, one class per format, all called as `kernel(x, bias)`.

Which kernel runs depends on the batch (rows of x) and the device, from measurements on the
development machine (a 9728x896 matrix, 2 threads, median ms; docs/benchmarks.md, "Quantized weights"):

    rows               1      4      8     32     64
    bf16 (oneDNN)    0.51   0.52   0.53   0.66   0.85
    int8pack_mm      0.36   0.60   1.12   4.27   8.73     dequantize + GEMM: 3.3 (1-2 rows), ~18.5 from 4 rows
    int4pack_mm      0.30   0.51   1.00   4.57   7.78     dequantize + GEMM: 24-40
    fp8 dequantize + GEMM: 29-42 (PyTorch converts float8 element by element on CPU)

  - CPU int8 / fp8 with sieve's native kernels (sieve/kernels): a one-byte-weight GEMV up to 4 rows,
    and above that a native dequantize to bf16 (memory speed) + GEMM. Without them: int8 uses
    PyTorch's packed kernel up to SMALL_ROWS rows, fp8 dequantizes in PyTorch (slow, see above).
  - CPU int4: PyTorch's packed kernel at every batch size (it grows linearly with the rows, being
    compute-bound, but stays ahead of dequantizing in PyTorch).
  - CUDA: dequantize + GEMM, or FP8 `_scaled_mm` where the device has FP8 tensor cores.
A fused dequantizing GEMM (AMX tiles fed from int8/int4/fp8 weights) is what would make large
batches as fast as bf16; it is not written yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sieve.kernels import cpu_ops
from sieve.quant.formats import ChannelScaledWeight, Int4Weight

SMALL_ROWS = {"int8": 128}  # PyTorch's packed int8 kernel up to this many rows (see the table above)


class DequantKernel:
    """Dequantize into the activation dtype, then one GEMM. Works for every format and device."""

    def __init__(self, w, dtype: torch.dtype):
        self.w, self.dtype = w, dtype

    def dense(self) -> torch.Tensor:
        return self.w.dequantize(self.dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [T, K] -> [T, N]
        return F.linear(x, self.dense(), bias)


def _native_q8(w: ChannelScaledWeight, dtype: torch.dtype):
    """sieve's AVX512 kernels for one-byte weights (CPU, bf16 activations), or None."""
    if w.q.device.type != "cpu" or dtype != torch.bfloat16:
        return None
    ops = cpu_ops()
    return ops if ops is not None and hasattr(ops, "gemv_q8") else None


class ChannelScaledKernel(DequantKernel):
    """int8 / fp8 weights with per-channel scales. CPU with the native kernels: the one-byte GEMV up
    to 4 rows, native dequantize + GEMM above. Otherwise int8 uses PyTorch's packed kernel up to
    SMALL_ROWS rows; anything else dequantizes in PyTorch."""

    def __init__(self, w: ChannelScaledWeight, dtype: torch.dtype):
        super().__init__(w, dtype)
        self.scale = w.scale.to(dtype)
        self.scale_f32 = w.scale.to(torch.float32).contiguous()
        self.native = _native_q8(w, dtype)
        self.int8pack = w.q.dtype == torch.int8 and w.q.device.type == "cpu"

    def dense(self) -> torch.Tensor:
        if self.native is not None:
            return self.native.dequant_q8(self.w.q, self.scale_f32)
        return self.w.q.to(self.dtype) * self.scale[:, None]

    def __call__(self, x, bias):
        rows = x.shape[0]
        if self.native is not None and rows <= self.native.gemv_max_rows and x.dtype == torch.bfloat16:
            return self.native.gemv_q8(x, self.w.q, self.scale_f32, bias)
        if self.native is None and self.int8pack and rows <= SMALL_ROWS["int8"]:
            y = torch._weight_int8pack_mm(x.contiguous(), self.w.q, self.scale)
            return y if bias is None else y + bias
        return F.linear(x, self.dense(), bias)



class Int4Kernel(DequantKernel):
    """CPU: PyTorch's int4 kernel for every batch (it beats dequantizing in PyTorch at every size
    measured). It wants its own layout, so on CPU the weight is held twice (0.5 + 0.5 bytes per value)
    while a step reads 0.5."""

    def __init__(self, w: Int4Weight, dtype: torch.dtype):
        super().__init__(w, dtype)
        self.packed = None
        n, kp = w.packed.shape[0], w.packed.shape[1] * 2
        fits = w.k == kp and w.k % 32 == 0 and n % 16 == 0  # the packed kernel's tiles
        if fits and w.packed.device.type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu"):
            # PyTorch's CPU int4 layout: w = (q - 8) * scale + zero_float, per [group, out] pair
            self.packed = torch._convert_weight_to_int4pack_for_cpu(w.values().to(torch.int32), 1)
            zero_float = (8 - w.zero.to(torch.float32)) * w.scale
            self.scales_and_zeros = torch.stack([w.scale, zero_float], dim=-1).transpose(0, 1).contiguous().to(dtype)

    def __call__(self, x, bias):
        if self.packed is not None and x.dtype == self.dtype:
            y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.w.group, self.scales_and_zeros)
            return y if bias is None else y + bias
        return F.linear(x, self.dense(), bias)


class Fp8Kernel(ChannelScaledKernel):
    def __init__(self, w: ChannelScaledWeight, dtype: torch.dtype):
        super().__init__(w, dtype)
        dev = w.q.device
        self.fp8_mm = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9)
        if self.fp8_mm:
            self.qt = w.q.t()  # column-major for _scaled_mm
            self.scale_b = w.scale.to(torch.float32)[None, :]

    def __call__(self, x, bias):
        if self.fp8_mm:  # W8A8 with a per-row activation scale
            a_scale = (x.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp(min=1e-12)
            xq = (x / a_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            return torch._scaled_mm(xq, self.qt, scale_a=a_scale, scale_b=self.scale_b, bias=bias, out_dtype=x.dtype)
        return super().__call__(x, bias)


def make_kernel(w, dtype: torch.dtype):
    if isinstance(w, Int4Weight):
        return Int4Kernel(w, dtype)
    if isinstance(w, ChannelScaledWeight) and w.q.dtype == torch.int8:
        return ChannelScaledKernel(w, dtype)
    if isinstance(w, ChannelScaledWeight) and w.q.dtype == torch.float8_e4m3fn:
        return Fp8Kernel(w, dtype)
    raise TypeError(f"no kernel for {type(w).__name__}")
