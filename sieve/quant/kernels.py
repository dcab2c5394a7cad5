"""Matmul kernels for quantized weights, all called as `kernel(x, bias)`; `nbytes` is what one pass
reads.

CPU, bf16 or float32 activations, sieve's native kernels built (`BlockedKernel`): the weight is repacked once,
at load time, into the blocked layout of sieve/kernels/qmatmul.cpp, where 32 decoded weights are one
operand of a bf16 dot product against a broadcast pair of inputs. Every batch size is multiplied
straight from that layout, so a weight is held once. Measured on the development machine (2 Zen 5
cores, every linear of a Qwen2.5-0.5B-shaped model once, ms, min of 5 interleaved passes; bf16 at 1-4
rows is sieve's GEMV, above that oneDNN on prepacked weights):

    rows               1      8     32     64    128   2048
    bf16            13.7   20.9   39.5   62.2  112.2   1966
    int8             7.4   11.4   33.5   59.5  113.0   2078
    fp8              7.2   10.6   30.9   56.6  107.7   2091
    int4 (group 128) 5.0   10.8   32.2   58.6  111.7   2077

Decoding to a plain bf16 matrix for one oneDNN GEMM, the way prefill ran before, was slower at every
size measured (128 rows: 192 ms; 512: 500 against 455; 2048: 2,122 against 2,096). At prefill sizes
the kernel is compute-bound and runs ~6% behind oneDNN's bf16 GEMM: weight-only quantization saves
no arithmetic there. fp8 decodes with a shift and a mask (its codes carry no subnormals), int8 with
two conversions, so fp8 is the cheaper of the two one-byte formats on this CPU, which has no FP8
arithmetic.

With `activation_quantization="int8"` (CPU, opt-in, lossy), the int4 `NativeLinear`s switch to int8 activations
per 32 inputs and integer dot products (AVX2, or AVX512-VNNI where the CPU has it, and AMX-INT8 tiles for calls of
10 rows and more where it has those: the same bits; sieve/kernels/qmatmul_q8act.cpp; ModelRunner sets the flag).

On CUDA (fp16 / bf16 activations): int8 and int4 in every layout run one Triton GEMM that dequantizes
tiles inside the product (sieve/quant/triton_kernels.py), fp8 the FP8 matmul (`_scaled_mm`) on GPUs
that have it. On CPUs without native kernels: int8 uses PyTorch's packed kernel for small batches,
int4 PyTorch's CPU int4 kernel where its tile shapes fit; anything else dequantizes into the
activation dtype for one GEMM on every call (the load log warns).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sieve.kernels import cpu_ops
from sieve.quant.formats import ChannelScaledWeight, Int4Weight

SMALL_ROWS = {"int8": 128}  # PyTorch's packed int8 kernel up to this many rows (CPU without native kernels)


def _pad_rows(t: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, -t.shape[0] % multiple))


def block_bytes(q: torch.Tensor) -> torch.Tensor:
    """[N, K] one-byte codes -> uint8 [N/16, K/2, 32]: for each 16 rows, the pairs (w[n, 2p], w[n, 2p+1])."""
    b = F.pad(_pad_rows(q.view(torch.uint8)), (0, q.shape[1] % 2))
    nb, k2 = b.shape[0] // 16, b.shape[1]
    return b.view(nb, 16, k2 // 2, 2).permute(0, 2, 1, 3).reshape(nb, k2 // 2, 32).contiguous()


def block_groups(t: torch.Tensor) -> torch.Tensor:
    """Per-(row, group) values [N, G] -> float16 [N/16, G, 16]: a block's 16 rows side by side per group."""
    t = _pad_rows(t.to(torch.float16))
    return t.view(t.shape[0] // 16, 16, t.shape[1]).transpose(1, 2).contiguous()


def block_int4(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (uint8 [N/16, Kp/4, 32]: byte 2c + i of unit u = w[n, 4u + i] | w[n, 4u + 2 + i] << 4,
    scale and min as float16 [N/16, G, 16]; min None for a weight without one)."""
    v = _pad_rows(w.values())
    nb, kp = v.shape[0] // 16, v.shape[1]
    u = v.view(nb, 16, kp // 4, 2, 2).permute(0, 2, 3, 1, 4)  # [nb, unit, which pair, row, input]
    blocked = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(nb, kp // 4, 32).contiguous()
    return blocked, block_groups(w.scale), None if w.min is None else block_groups(w.min)


class BlockedKernel:
    """sieve's native kernel for int8 / fp8 / int4 weights (CPU, bf16 activations), as a `NativeLinear`
    (sieve/kernels/linear.cpp) that the native layer loop calls too."""

    def __init__(self, w: ChannelScaledWeight | Int4Weight, ops, bias: torch.Tensor | None = None):
        self.nbytes, self.kind = w.nbytes, w.kind
        panel_kind = "int4" if isinstance(w, Int4Weight) else "q8_0" if w.kind == "int8" and w.scale.dim() == 2 else w.kind
        panels = ops.quantized_panel_rows(panel_kind) if hasattr(ops, "quantized_panel_rows") else 0
        self.name = f"{w.describe()} ({ops.isa} kernel)" + (f", float32 panels from {panels} rows" if panels else "")
        if isinstance(w, Int4Weight) and w.group % 32 == 0 and w.group <= 256 and getattr(ops, "int4_amx", bool)():
            # sieve/kernels/qmatmul.cpp: the tiles from that many rows, FMAs in their order below (the same bits)
            self.name = f"{w.describe()} ({ops.isa} kernel), AMX tiles from {ops.int4_amx_rows()} rows"
        if isinstance(w, Int4Weight):
            blocked, scale, aux = block_int4(w)
            kind, group, n, k = ops.LINEAR_INT4, w.group, w.scale.shape[0], w.k
        else:
            grouped = w.scale.dim() == 2
            blocked, aux = block_bytes(w.q), None
            scale = block_groups(w.scale) if grouped else w.scale.to(torch.float32).contiguous()
            kind, group, (n, k) = ops.LINEAR_Q8, w.group if grouped else 0, w.q.shape
        self.native = ops.NativeLinear(kind, blocked, None, scale, aux, w.kind == "fp8", group, n, k, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.native(x)


class DequantKernel:
    """Dequantize into the activation dtype, then one GEMM. Works for every format and device."""

    widens = True  # every call dequantizes the whole matrix: the slow path the load log warns about

    def __init__(self, w, dtype: torch.dtype, bias: torch.Tensor | None = None):
        self.w, self.dtype, self.nbytes, self.bias = w, dtype, w.nbytes, bias
        self.name = f"{w.describe()} (dequantized to {str(dtype).removeprefix('torch.')} on every call)"

    def dense(self) -> torch.Tensor:
        return self.w.dequantize(self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        return F.linear(x, self.dense(), self.bias)


class Int8Kernel(DequantKernel):
    """PyTorch's packed int8 kernel (CPU) for small batches (per-channel scales)."""

    def __init__(self, w: ChannelScaledWeight, dtype: torch.dtype, bias=None):
        super().__init__(w, dtype, bias)
        self.scale = w.scale.to(dtype)
        self.int8pack = w.q.device.type == "cpu"
        if self.int8pack:
            self.name = f"{w.describe()} (PyTorch int8 kernel up to {SMALL_ROWS['int8']} rows, else dequantized per call)"
            self.widens = False

    def __call__(self, x):
        if self.int8pack and x.shape[0] <= SMALL_ROWS["int8"] and x.dtype == self.dtype:
            y = torch._weight_int8pack_mm(x.contiguous(), self.w.q, self.scale)
            return y if self.bias is None else y + self.bias
        return super().__call__(x)


class Int4Kernel(DequantKernel):
    """PyTorch's CPU int4 kernel where its tile shapes fit. It wants its own layout, so the weight is held
    twice (0.5 + 0.5 bytes per value) while a pass reads 0.5."""

    def __init__(self, w: Int4Weight, dtype: torch.dtype, bias=None):
        super().__init__(w, dtype, bias)
        self.packed = None
        n, kp = w.packed.shape[0], w.packed.shape[1] * 2
        fits = w.k == kp and w.k % 32 == 0 and n % 16 == 0
        if fits and w.packed.device.type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu"):
            # PyTorch's CPU int4 layout: w = (q - 8) * scale + zero_float, per [group, out] pair
            self.packed = torch._convert_weight_to_int4pack_for_cpu(w.values().to(torch.int32), 1)
            scale = w.scale.float()
            zero_float = 8 * scale + (-8 * scale if w.min is None else w.min.float())
            self.scales_and_zeros = torch.stack([scale, zero_float], dim=-1).transpose(0, 1).contiguous().to(dtype)
            self.name = f"{w.describe()} (PyTorch int4 kernel)"
            self.widens = False

    def __call__(self, x):
        if self.packed is not None and x.dtype == self.dtype:
            y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.w.group, self.scales_and_zeros)
            return y if self.bias is None else y + self.bias
        return super().__call__(x)


class Fp8Kernel(DequantKernel):
    """W8A8 FP8 matmul (`_scaled_mm`, a per-row activation scale) on GPUs with FP8 tensor cores."""

    def __init__(self, w: ChannelScaledWeight, dtype: torch.dtype, bias=None):
        super().__init__(w, dtype, bias)
        dev = w.q.device
        self.fp8_mm = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9)
        if self.fp8_mm:
            self.qt = w.q.t()  # column-major for _scaled_mm
            self.scale_b = w.scale.to(torch.float32)[None, :]
            self.name = f"{w.describe()} (FP8 tensor cores, _scaled_mm)"
            self.widens = False

    def __call__(self, x):
        if self.fp8_mm:
            a_scale = (x.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp(min=1e-12)
            xq = (x / a_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            return torch._scaled_mm(xq, self.qt, scale_a=a_scale, scale_b=self.scale_b, bias=self.bias, out_dtype=x.dtype)
        return super().__call__(x)


def _native_ops(w, dtype: torch.dtype):
    """sieve's native quantized kernels when they apply: CPU, bf16 or float32 activations (float32 is
    rounded to bf16 for the products; the output stays float32), shapes they take."""
    device = (w.packed if isinstance(w, Int4Weight) else w.q).device
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return None
    if isinstance(w, Int4Weight) and w.group % 4:
        return None
    if isinstance(w, ChannelScaledWeight) and w.scale.dim() == 2 and (w.group % 2 or w.kind != "int8"):
        return None
    ops = cpu_ops()
    return ops if ops is not None and hasattr(ops, "qmatmul_q8") else None


def make_kernel(w, dtype: torch.dtype, bias: torch.Tensor | None = None):
    """The kernel for weight `w` and activations of `dtype`: called as `kernel(x)`, bias included."""
    if isinstance(w, ChannelScaledWeight) and w.acts == "int8":
        from sieve.quant.w8a8 import W8A8Kernel

        return W8A8Kernel(w, dtype, bias)
    ops = _native_ops(w, dtype)
    if ops is not None:
        return BlockedKernel(w, ops, bias)
    device = (w.packed if isinstance(w, Int4Weight) else w.q).device
    fp8 = isinstance(w, ChannelScaledWeight) and w.kind == "fp8"
    if not fp8 and device.type == "cuda":
        from sieve.quant import triton_kernels

        if triton_kernels.available(device, dtype):
            return triton_kernels.TritonKernel(w, dtype, bias)
    if isinstance(w, Int4Weight):
        return Int4Kernel(w, dtype, bias)
    if isinstance(w, ChannelScaledWeight) and w.kind == "int8" and w.scale.dim() == 1:
        return Int8Kernel(w, dtype, bias)
    if isinstance(w, ChannelScaledWeight) and w.kind == "fp8":
        return Fp8Kernel(w, dtype, bias)
    if isinstance(w, ChannelScaledWeight):
        return DequantKernel(w, dtype, bias)
    raise TypeError(f"no kernel for {type(w).__name__}")
