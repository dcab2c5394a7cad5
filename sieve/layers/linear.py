"""Linear layers. Quantization replaces the weight by a smaller format at load time (`prepare`) and
picks that format's kernel (sieve/quant); model code never changes.

`Linear` may hold several checkpoint matrices stacked along the output dimension (q/k/v, gate/up)
so that one GEMM serves them all; `shard_sizes` says where each lands. A checkpoint may bring a shard
already quantized (GGUF Q8_0 / Q4_0 / Q4_1, AWQ): it is kept in that format, never widened. Shards of
one format stack into one kernel; a stack whose shards differ runs one kernel per shard.

Kernels, chosen once after loading (`prepare`), by shape and device, from measurements on this machine:
  - CPU, bf16, with sieve's native kernels: a `NativeLinear` (sieve/kernels/linear.cpp), which the
    native layer loop calls too. Up to `gemv_max_rows` rows (decode) the two-stream GEMV, 21 ms per
    pass over a whole 0.5B model's weights (46 GB/s) against ~26 ms for oneDNN; larger batches
    oneDNN's prepacked layout (`mkldnn._linear_pointwise`), 1.4-1.6x `F.linear` from batch 1 to 256,
    bit-identical output. The packed copy doubles the weight's memory, so the loader allows it only
    where memory is ample; without it larger batches run `F.linear` on the plain weight. Where the CPU's
    vdpbf16ps is slower than two float32 FMAs (`ops.bf16_dot_kernel() == "fma"`, e.g. Emerald Rapids),
    larger batches take float32 FMAs on panels of the widened weight instead (gemm_bf16.cpp: 1.1-1.6x
    oneDNN from 16 to 2048 rows there), as the AVX2 build always does, and no packed copy is made.
  - quantized weights: their format's kernel (sieve/quant/kernels.py).
  - everything else (float32, CUDA): `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sieve.kernels import cpu_ops

_PACK_BATCH_HINT = 16  # oneDNN picks a layout for this batch size; 16 is near-best from 1 to 64 here


def _float32_panels(ops) -> bool:
    """Whether the native bf16 linear multiplies batches above the GEMV's rows itself, with float32 FMAs on panels of
    the widened weight: always in the AVX2 build, and in the AVX512-BF16 build where this CPU's vdpbf16ps is slower
    than the two FMAs it is defined as (sieve/kernels/gemm_bf16.cpp)."""
    return ops.isa == "avx2" or (ops.isa == "avx512-bf16" and ops.bf16_dot_kernel() == "fma")


def _can_pack(w: torch.Tensor) -> bool:
    return (
        w.device.type == "cpu"
        and w.dtype in (torch.bfloat16, torch.float16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear(nn.Module):
    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.shard_sizes = list(shard_sizes)
        out_features = sum(shard_sizes)
        self.dtype = dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN layout of `weight` (CPU bf16/fp16, no native kernels)
        self.native = None  # sieve.kernels NativeLinear: the whole forward, bias included (CPU bf16)
        self.qkernel = None  # quantized weight and its kernel (sieve.quant), replacing `weight`
        self.quantized_shards: dict[int, object] = {}  # shards a checkpoint brought quantized
        self.awq_parts: dict[int, dict[str, torch.Tensor]] = {}  # AWQ checkpoint tensors per output shard

    @property
    def out_features(self) -> int:
        return sum(self.shard_sizes)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight one forward reads (the quantized format's, scales included)."""
        return self.qkernel.nbytes if self.qkernel is not None else self.weight.numel() * self.weight.element_size()

    def load(self, name: str, tensor, shard: int = 0) -> None:
        """Copy checkpoint tensor `name` ('weight' or 'bias'; 'qweight', 'qzeros', 'scales' from an AWQ
        checkpoint) into output shard `shard`. A quantized weight (sieve.quant.formats) is kept as it is."""
        if name in ("qweight", "qzeros", "scales"):
            self.awq_parts.setdefault(shard, {})[name] = tensor
            return
        rows_wanted = self.shard_sizes[shard]
        if name == "weight" and not isinstance(tensor, torch.Tensor):
            shape = (tensor.q.shape if hasattr(tensor, "q") else (tensor.packed.shape[0], tensor.k))
            if tuple(shape) != (rows_wanted, self.in_features):
                raise ValueError(f"shape mismatch loading {name}: checkpoint {tuple(shape)}, model {(rows_wanted, self.in_features)}")
            self.quantized_shards[shard] = tensor
            return
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {name} this layer does not expect")
        start = sum(self.shard_sizes[:shard])
        rows = target.narrow(0, start, rows_wanted)
        if rows.shape != tensor.shape:
            raise ValueError(f"shape mismatch loading {name}: checkpoint {tuple(tensor.shape)}, model {tuple(rows.shape)}")
        rows.copy_(tensor)

    @property
    def is_prequantized(self) -> bool:
        return bool(self.quantized_shards or self.awq_parts)

    def prepare(self, allow_two_layouts: bool, quantization: str | None = None, group_size: int = 128) -> None:
        """Pick the kernels for this device and dtype, once, after the weights are loaded; with
        `quantization`, first replace the weight by that format (the full-precision copy is dropped).
        Shards that arrived quantized keep their format whatever `quantization` says."""
        from sieve.quant.formats import concat_rows, quantize, same_layout
        from sieve.quant.kernels import make_kernel

        bias = self.bias.detach() if self.bias is not None else None
        if self.awq_parts:  # an AWQ checkpoint arrives already quantized
            self.quantized_shards.update(_awq_shards(self.awq_parts, self.shard_sizes, group_size))
            self.awq_parts = {}
        if self.quantized_shards:
            parts = [self.quantized_shards.get(i) for i in range(len(self.shard_sizes))]
            if all(p is not None for p in parts) and same_layout(parts):
                self.qkernel = make_kernel(concat_rows(parts), self.dtype, bias)
            else:  # shards of different formats (or plain ones among them): one kernel each
                self.qkernel = ShardedKernel(self, parts, bias)
        elif quantization is not None:
            if quantization == "awq":
                raise ValueError("quantization 'awq' needs an AWQ checkpoint: make one with `sieve quantize --method awq`")
            self.qkernel = make_kernel(quantize(self.weight.detach(), quantization, group_size), self.dtype, bias)
        if self.qkernel is not None:
            self.quantized_shards = {}
            self.weight = None
            self.native = getattr(self.qkernel, "native", None)
            return
        w = self.weight
        ops = cpu_ops() if w.device.type == "cpu" and w.dtype == torch.bfloat16 else None
        native = ops is not None and hasattr(ops, "gemv_bf16")
        panels = native and _float32_panels(ops)  # the kernel multiplies every batch itself: no packed copy
        if _can_pack(w) and (not native or allow_two_layouts) and not panels:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_BATCH_HINT)
            except RuntimeError:
                self.packed = None
        if native:
            self.native = ops.NativeLinear(ops.LINEAR_BF16, w.detach(), self.packed, None, None, False, 0, *w.shape, bias)

    def kernel_name(self) -> str:
        if self.qkernel is not None:
            return self.qkernel.name
        dtype = str(self.dtype).removeprefix("torch.")
        if self.native is not None:
            ops = cpu_ops()
            above = "float32 panels" if _float32_panels(ops) else "oneDNN packed" if self.packed is not None else "ATen"
            return f"{dtype} ({ops.isa} GEMV; {above} above {ops.gemv_max_rows} rows)"
        return f"{dtype} ({'oneDNN packed' if self.packed is not None else 'F.linear'})"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.native is not None:
            return self.native(x)
        if self.qkernel is not None:
            return self.qkernel(x)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class ShardedKernel:
    """A stack whose shards came in different formats: each shard's kernel (plain shards: their rows of
    the layer's weight), outputs concatenated."""

    def __init__(self, layer: Linear, parts: list, bias: torch.Tensor | None):
        from sieve.quant.kernels import make_kernel

        self.kernels, start, self.nbytes = [], 0, 0
        self.name = "per shard: " + " | ".join("plain" if p is None else p.describe() for p in parts)
        for size, part in zip(layer.shard_sizes, parts):
            b = bias[start : start + size] if bias is not None else None
            if part is None:
                w = layer.weight.detach()[start : start + size].contiguous()
                self.kernels.append(lambda x, w=w, b=b: F.linear(x, w, b))
                self.nbytes += w.numel() * w.element_size()
            else:
                k = make_kernel(part, layer.dtype, b)
                self.kernels.append(k)
                self.nbytes += k.nbytes
            start += size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([k(x) for k in self.kernels], dim=-1)


def _awq_shards(parts: dict[int, dict[str, torch.Tensor]], shard_sizes: list[int], group: int) -> dict[int, object]:
    """AutoAWQ tensors of each stacked matrix (q, k, v or gate, up) -> one int4 weight per shard."""
    from sieve.quant.awq import from_awq_tensors

    if sorted(parts) != list(range(len(shard_sizes))) or any(len(p) != 3 for p in parts.values()):
        raise ValueError("an AWQ checkpoint must give qweight, qzeros and scales for every matrix of a layer")
    return {i: from_awq_tensors(parts[i]["qweight"], parts[i]["qzeros"], parts[i]["scales"], n, group)
            for i, n in enumerate(shard_sizes)}
