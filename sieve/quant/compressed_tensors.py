"""llm-compressor's checkpoint layout ("compressed-tensors") for W8A8, the one vLLM and SGLang load as
`CompressedTensorsW8A8Int8`: a file moves between them and sieve either way.

config.json gets
    "quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"],
            "weights":           {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel", "dynamic": false},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "token", "dynamic": true}}}}
and each quantized linear `<name>` holds `<name>.weight` (int8 [out, in]) and `<name>.weight_scale` ([out, 1]:
w = q * scale); a symmetric scheme writes no zero point. The modules `ignore` names (and any linear written without
a scale) stay in the checkpoint's float dtype.

sieve serves this scheme only: int8 weights per output channel, int8 activations per token, dynamic (the arithmetic
of sieve/quant/w8a8.py). Anything else compressed-tensors can describe (4-bit packed weights, FP8, static or
per-tensor activation scales, groups, zero points) is refused by name rather than loaded as something else.
"""

from __future__ import annotations

import torch

from sieve.models.arch import UnsupportedModelError
from sieve.quant.formats import ChannelScaledWeight

WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


class CheckpointLayoutError(UnsupportedModelError):
    """A compressed-tensors checkpoint whose scheme sieve does not serve, or whose tensors do not fit it."""


def w8a8_config(ignore: tuple[str, ...] = ("lm_head",)) -> dict:
    """The `quantization_config` of a W8A8 checkpoint (the module docstring)."""
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "ignore": list(ignore), "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(WEIGHTS, group_size=None),
                                          "input_activations": dict(ACTIVATIONS, group_size=None), "output_activations": None}}}


def check_config(qc: dict) -> None:
    """CheckpointLayoutError unless `qc` is the W8A8 scheme sieve serves, naming the first field that differs."""
    fmt = qc.get("format")
    if fmt not in ("int-quantized", "naive-quantized"):
        raise CheckpointLayoutError(f"compressed-tensors format {fmt!r} is not supported: sieve loads W8A8 'int-quantized' "
                                    "checkpoints (int8 weights per channel, int8 activations per token)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise CheckpointLayoutError(f"compressed-tensors: {len(groups)} config groups; sieve loads one W8A8 scheme for every Linear")
    group = next(iter(groups.values()))
    for part, want in (("weights", WEIGHTS), ("input_activations", ACTIVATIONS)):
        got = group.get(part) or {}
        for key, value in want.items():
            if got.get(key, None) != value:
                raise CheckpointLayoutError(f"compressed-tensors: {part}.{key} is {got.get(key)!r}; sieve serves W8A8 with "
                                            f"{part}.{key} = {value!r} (int8 weights per channel, int8 activations per token, dynamic)")
    if group.get("output_activations"):
        raise CheckpointLayoutError("compressed-tensors: quantized output activations are not supported")
    if qc.get("kv_cache_scheme"):
        raise CheckpointLayoutError("compressed-tensors: a kv_cache_scheme is not supported (sieve's --kv-cache-dtype is)")


def to_tensors(w: ChannelScaledWeight) -> dict[str, torch.Tensor]:
    """A W8A8 weight -> its `weight` and `weight_scale` tensors."""
    return {"weight": w.q.contiguous(), "weight_scale": w.scale.to(torch.float32)[:, None].contiguous()}


def from_tensors(name: str, q: torch.Tensor, scale: torch.Tensor) -> ChannelScaledWeight:
    """`<name>.weight` and `<name>.weight_scale` -> a W8A8 weight; CheckpointLayoutError naming the tensor whose
    dtype or shape does not fit the scheme."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise CheckpointLayoutError(f"{name}.weight is {q.dtype} {tuple(q.shape)}; W8A8 stores int8 [out, in]")
    n = q.shape[0]
    if tuple(scale.shape) not in ((n, 1), (n,)) or not scale.is_floating_point():
        raise CheckpointLayoutError(f"{name}.weight_scale is {scale.dtype} {tuple(scale.shape)}; a channel-wise W8A8 "
                                    f"scale is a float [{n}, 1] (one per output row of {name}.weight {tuple(q.shape)})")
    s = scale.reshape(n).to(torch.float32)
    if not torch.isfinite(s).all() or (s < 0).any():
        raise CheckpointLayoutError(f"{name}.weight_scale holds a negative or non-finite scale")
    return ChannelScaledWeight(q, s, acts="int8")
