"""The gated MLP's activation on the fused gate|up projection: silu(gate) * up, or GeGLU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sieve.kernels import cpu_ops
from sieve.layers import pointwise_triton


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> [T, I]. bf16 and float32 on CPU: one native kernel that rounds where PyTorch's two
    ops round (silu to bf16, then the product), the one the C++ layer loop runs, so that the Python loop gives its bits
    (in float32 PyTorch's exp differs from it in the last bit); otherwise PyTorch."""
    if (gate_up.dtype in (torch.bfloat16, torch.float32) and gate_up.device.type == "cpu" and gate_up.dim() == 2
            and gate_up.stride(-1) == 1 and not gate_up.requires_grad):  # the kernel records no gradient
        ops = cpu_ops()
        if ops is not None:
            return ops.silu_mul(gate_up)
    if pointwise_triton.supports(gate_up):  # CUDA: one launch (sieve/layers/pointwise_triton.py)
        return pointwise_triton.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> gelu_tanh(gate) * up [T, I]: Gemma's GeGLU (transformers' gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
