"""A LoRA adapter in PEFT's format (`adapter_config.json`, `adapter_model.safetensors`), read and checked against the
model it will run on, and laid out for sieve's fused projections (its sites: sieve/lora/sites.py).

sieve's decoder fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj`. A fused module's adapters become
one pair of matrices: the A's stacked ([r_q + r_k + r_v, in]) and the B's block-diagonal ([out, r_q + r_k + r_v], each
B in its own output rows and its own rank columns), so one low-rank product serves the fused output. The scaling
(`lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA) is folded into B. Both are kept transposed (A^T [in, R],
B^T [R, out]): x A^T B^T is then x @ A^T @ B^T, and the C++ kernel's products are axpys over contiguous rows.

Everything a file could get wrong is refused by name (LoRAError) before anything is kept: a missing file, a rank over
the maximum, a module the model lacks (or that is not a linear sieve runs LoRA on), shapes that do not match, a layer
out of range, and the PEFT options sieve does not run (DoRA, biases, modules_to_save, fan_in_fan_out)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sieve.lora.sites import KEY, MODEL, MODEL_KEY, NAMES, layer_sites, site_of


class LoRAError(ValueError):
    """An adapter that cannot be served, and why."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest rank of any of its modules
    fingerprint: str  # sha256 of its weights and config: what its KV depends on besides the base model
    # (layer, site) -> (A^T [in, R], B^T [R, out] with the scaling folded in), in the model's dtype and device
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # the dense sites' matrices (MODULES) for sieve's CPU kernels (NativeLoRA), which then hold the only copy of those
    native: object = None
    modules: set = field(default_factory=set)  # the (layer, site) pairs it changes
    # tensor parallelism, on the driver: (config, tensors) as read, which it sends the other ranks to shard for
    # themselves (sieve/distributed/lora_ranks.py)
    source: tuple | None = None



def read_config(path: Path) -> dict:
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except OSError as e:
        raise LoRAError(f"{path}: cannot read adapter_config.json ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise LoRAError(f"{path}/adapter_config.json is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{path}/adapter_config.json must be a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, ok, why in (("use_dora", lambda v: not v, "DoRA adapters are not supported"),
                         ("bias", lambda v: v in (None, "none"), "adapters that train biases are not supported"),
                         ("modules_to_save", lambda v: not v, "adapters with modules_to_save (whole modules) are not supported"),
                         ("fan_in_fan_out", lambda v: not v, "fan_in_fan_out (Conv1D) layouts are not supported")):
        if not ok(config.get(key)):
            raise LoRAError(f"{path}: {why} ({key} = {config.get(key)!r})")
    return config


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise LoRAError(f"{path}: no adapter_model.safetensors (PEFT's format: adapter_config.json and adapter_model.safetensors)")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAError(f"{file}: not a safetensors file ({e})") from None


def scaling(config: dict, module: str, rank: int) -> float:
    alpha = (config.get("alpha_pattern") or {}).get(module, config.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def pairs(path: Path, tensors: dict[str, torch.Tensor], arch) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, PEFT module path in it) -> {"A": ..., "B": ...}, every key named and every module a site of the model."""
    found = {}
    for key, tensor in tensors.items():
        m, head = KEY.match(key), MODEL_KEY.match(key)
        if key.endswith(".base_layer.weight"):
            raise LoRAError(f"{path}: {key}: the adapter carries a whole weight of the model (PEFT's save_embedding_layers, "
                            "for a resized vocabulary); sieve serves adapters over the base model's own weights (save it "
                            "with save_embedding_layers=False where the vocabulary is the base model's)")
        if m is None and head is None:
            raise LoRAError(f"{path}: {key}: not a LoRA weight of a linear sieve runs LoRA on ({NAMES})")
        layer, module, which = (int(m[1]), m[2], m[3]) if m is not None else (MODEL, head[1], head[2])
        try:
            site_of(arch, layer, module)
        except ValueError as e:
            raise LoRAError(f"{path}: {key}: {e}") from None
        found.setdefault((layer, module), {})[which] = tensor
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{path}: layer {layer} {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
    if not found:
        raise LoRAError(f"{path}: adapter_model.safetensors holds no LoRA weights")
    return found


def load_adapter(name: str, path: str, arch, max_rank: int, dtype: torch.dtype, device: torch.device, tp=None) -> LoRAAdapter:
    """Read and check the adapter at `path` for a model of `arch`; its weights laid out per fused module. With `tp`
    (a tensor-parallel group; `arch` is then the whole model's), this rank's shard of them, and the file's contents
    kept (`source`) for the driver to send the other ranks."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"{path}: no such adapter folder")
    config, tensors = read_config(folder), read_tensors(folder)
    adapter = adapter_from(name, str(folder), config, tensors, arch, max_rank, dtype, device, tp)
    if tp is not None:
        adapter.source = (config, tensors)
    return adapter


def adapter_from(name: str, path: str, config: dict, tensors: dict[str, torch.Tensor], arch, max_rank: int,
                 dtype: torch.dtype, device: torch.device, tp=None) -> LoRAAdapter:
    """The adapter an `adapter_config.json` and `adapter_model.safetensors` make (as read), checked against the whole
    model `arch`; with `tp`, this rank's shard (sieve.distributed.shard: a column-parallel module's B rows and a
    row-parallel module's A columns, split as the base weight is)."""
    parts, rank = checked_pairs(Path(path), config, tensors, arch, max_rank)
    local = arch
    if tp is not None:
        from sieve.distributed.shard import shard_arch, shard_lora

        parts = [(layer, module, *shard_lora(module.rpartition(".")[2], a, b, arch, tp)) for layer, module, a, b in parts]
        local = shard_arch(arch, tp.world_size)
    weights = lay_out(parts, local, dtype, device)
    adapter = LoRAAdapter(name, path, rank, fingerprint(config, tensors), weights, modules=set(weights))
    adapter.native = native_lora(weights, arch.num_layers, dtype, device)
    if adapter.native is not None:  # it keeps its own copy of the dense sites, laid out as its kernel reads them
        adapter.weights = {key: ab for key, ab in weights.items() if key[1] not in MODULES}
    return adapter


def checked_pairs(path: Path, config: dict, tensors: dict[str, torch.Tensor], arch, max_rank: int) -> tuple[list, int]:
    """[(layer, PEFT module path, A [r, in], B [out, r] with the scaling folded in)], float32, every shape checked
    against `arch`; and the largest rank."""
    rank, parts = 0, []
    for (layer, module), ab in sorted(pairs(path, tensors, arch).items()):
        a, b = ab["A"], ab["B"]
        site, shard = site_of(arch, layer, module)
        in_features, outs = layer_sites(arch, layer)[site]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (outs[shard], r):
            raise LoRAError(f"{path}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                            f"this model's {module} ({in_features} -> {outs[shard]}): A must be [r, {in_features}], "
                            f"B [{outs[shard]}, r]")
        if r > max_rank:
            raise LoRAError(f"{path}: layer {layer} {module} has rank {r}, over this server's --max-lora-rank {max_rank}")
        rank = max(rank, r)
        parts.append((layer, module, a.float(), b.float() * scaling(config, module.rpartition(".")[2], r)))
    return parts, rank


def lay_out(parts: list, arch, dtype: torch.dtype, device: torch.device) -> dict:
    """(layer, site) -> (A^T, B^T) of the (fused) module, for a model of `arch` (a rank's shard under tensor
    parallelism): the A's stacked, the B's block-diagonal."""
    per_site: dict[tuple[int, str], list] = {}
    for layer, module, a, b in parts:
        site, shard = site_of(arch, layer, module)
        per_site.setdefault((layer, site), []).append((shard, a, b))
    weights = {}
    for (layer, site), group in per_site.items():
        in_features, outs = layer_sites(arch, layer)[site]
        if len(outs) == 1:  # (a vocab-parallel head's rows are this rank's share, padded)
            outs = [group[0][2].shape[0]]
        offsets = [sum(outs[:i]) for i in range(len(outs))]
        total = sum(a.shape[0] for _, a, _ in group)
        A, B, col = torch.zeros(total, in_features), torch.zeros(sum(outs), total), 0
        for shard, a, b in group:
            A[col: col + a.shape[0]] = a
            B[offsets[shard]: offsets[shard] + outs[shard], col: col + a.shape[0]] = b
            col += a.shape[0]
        weights[(layer, site)] = (A.t().to(device=device, dtype=dtype).contiguous(), B.t().to(device=device, dtype=dtype).contiguous())
    return weights


def fingerprint(config: dict, tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for key in sorted(tensors):
        digest.update(key.encode())
        digest.update(tensors[key].float().numpy().tobytes())
    return digest.hexdigest()


MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the C++ layer loop's order


def native_lora(weights: dict, num_layers: int, dtype: torch.dtype, device: torch.device):
    """The adapter's matrices for sieve's C++ layer loop (None where it does not run: not a CPU, no kernels, or a
    dtype it does not take)."""
    from sieve.kernels import cpu_ops

    ops = cpu_ops() if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) else None  # (the loop checks the pair)
    if ops is None or not hasattr(ops, "NativeLoRA"):
        return None
    native = ops.NativeLoRA(num_layers)
    for (layer, module), (a, b) in weights.items():
        if module in MODULES:
            native.set(layer, MODULES.index(module), a, b)
    return native
