"""Linear layers. Quantization replaces the weight by a smaller format at load time (`prepare`) and
picks that format's kernel (sieve/quant); model code never changes.

`Linear` may hold several checkpoint matrices stacked along the output dimension (q/k/v, gate/up)
so that one GEMM serves them all; `shard_sizes` says where each lands.

Kernels, chosen once after loading (`prepare`), by shape and device, from measurements on this machine:
  - CPU, bf16, up to `gemv_max_rows` rows (decode): the native two-stream GEMV (sieve/kernels), 21 ms per
    pass over a whole 0.5B model's weights (46 GB/s) against ~26 ms for oneDNN. Needs the plain weight, so
    when a packed copy is kept too, weights take twice the memory; the loader allows it only where memory
    is ample.
  - CPU, bf16/fp16, larger batches: oneDNN's prepacked weight layout (`mkldnn._linear_pointwise`),
    1.4-1.6x the throughput of `F.linear` on the same weights from batch 1 to 256, bit-identical output.
  - everything else (float32, CUDA): `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sieve.kernels import cpu_ops

_PACK_BATCH_HINT = 16  # oneDNN picks a layout for this batch size; 16 is near-best from 1 to 64 here


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
        self.packed: torch.Tensor | None = None  # oneDNN layout of `weight` (CPU bf16/fp16)
        self.gemv = None  # native small-batch kernel (CPU bf16)
        self.gemv_max_rows = 0
        self.qkernel = None  # quantized weight and its kernel (sieve.quant), replacing `weight`
        self.awq_parts: dict[int, dict[str, torch.Tensor]] = {}  # AWQ checkpoint tensors per output shard

    @property
    def out_features(self) -> int:
        return sum(self.shard_sizes)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight one forward reads (the quantized format's, scales included)."""
        return self.qkernel.nbytes if self.qkernel is not None else self.weight.numel() * self.weight.element_size()

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        """Copy checkpoint tensor `name` ('weight' or 'bias'; 'qweight', 'qzeros', 'scales' from an AWQ
        checkpoint) into output shard `shard`."""
        if name in ("qweight", "qzeros", "scales"):
            self.awq_parts.setdefault(shard, {})[name] = tensor
            return
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {name} this layer does not expect")
        start = sum(self.shard_sizes[:shard])
        rows = target.narrow(0, start, self.shard_sizes[shard])
        if rows.shape != tensor.shape:
            raise ValueError(f"shape mismatch loading {name}: checkpoint {tuple(tensor.shape)}, model {tuple(rows.shape)}")
        rows.copy_(tensor)

    def prepare(self, allow_two_layouts: bool, quantization: str | None = None, group_size: int = 128) -> None:
        """Pick the kernels for this device and dtype, once, after the weights are loaded; with
        `quantization`, first replace the weight by that format (the full-precision copy is dropped)."""
        if quantization is not None:
            from sieve.quant.formats import quantize
            from sieve.quant.kernels import make_kernel

            if self.awq_parts:  # an AWQ checkpoint arrives already quantized
                qweight = _join_awq_shards(self.awq_parts, self.shard_sizes, group_size)
                self.awq_parts = {}
            elif quantization == "awq":
                raise ValueError("quantization 'awq' needs an AWQ checkpoint: make one with `sieve quantize --method awq`")
            else:
                qweight = quantize(self.weight.detach(), quantization, group_size)
            self.qkernel = make_kernel(qweight, self.dtype)
            self.weight = None
            return
        w = self.weight
        ops = cpu_ops() if w.device.type == "cpu" and w.dtype == torch.bfloat16 else None
        if ops is not None and hasattr(ops, "gemv_bf16"):
            self.gemv, self.gemv_max_rows = ops.gemv_bf16, ops.gemv_max_rows
        if _can_pack(w) and (self.gemv is None or allow_two_layouts):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_BATCH_HINT)
            except RuntimeError:
                self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.qkernel is not None:
            return self.qkernel(x, self.bias)
        if self.gemv is not None and x.shape[0] <= self.gemv_max_rows:
            return self.gemv(x, self.weight, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _join_awq_shards(parts: dict[int, dict[str, torch.Tensor]], shard_sizes: list[int], group: int):
    """AutoAWQ tensors of each stacked matrix (q, k, v or gate, up) -> one int4 weight."""
    from sieve.quant.awq import from_awq_tensors
    from sieve.quant.formats import Int4Weight

    if sorted(parts) != list(range(len(shard_sizes))) or any(len(p) != 3 for p in parts.values()):
        raise ValueError("an AWQ checkpoint must give qweight, qzeros and scales for every matrix of a layer")
    ws = [from_awq_tensors(parts[i]["qweight"], parts[i]["qzeros"], parts[i]["scales"], n, group)
          for i, n in enumerate(shard_sizes)]
    return Int4Weight(torch.cat([w.packed for w in ws]), torch.cat([w.scale for w in ws]), torch.cat([w.zero for w in ws]),
                      group, ws[0].k)
