"""Which part of each checkpoint tensor a tensor-parallel rank holds (Megatron's split, as vLLM does it).

- Column-parallel (outputs split): q, k and v by heads, gate and up by channels; each rank computes its own heads
  and channels with no communication.
- Row-parallel (inputs split): o_proj and down_proj; each rank's product is a partial sum, all-reduced once per
  attention block and once per MLP block (a bias is added by rank 0 alone).
- Vocab-parallel head: each rank scores a slice of the vocabulary; the logits are gathered.
- Embeddings and norms are replicated.

Quantized weights (GGUF Q8_0 / Q4_0 / Q4_1 kept as stored) shard the same way: rows freely, inputs on group
boundaries. Weights quantized at load (`--quantization`) are quantized after sharding.
"""

from __future__ import annotations

import dataclasses

import torch

from sieve.config import ConfigError
from sieve.models.arch import ModelArch
from sieve.quant.formats import narrow_cols, narrow_rows

from sieve.distributed.parallel import TensorParallelGroup

_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW = {"o_proj": "q", "down_proj": "mlp"}


def check_shardable(a: ModelArch, world_size: int) -> None:
    """A ConfigError naming what stops this model from splitting over `world_size` ranks."""
    if world_size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if world_size == 1:
        return
    for what, unsupported in (("mixture-of-experts layers", a.is_moe), ("multi-head latent attention", a.is_mla),
                              ("Mamba-2 layers", a.has_recurrent_state)):
        if unsupported:
            raise ConfigError(f"tensor parallelism is not built for {what} ({a.architecture}); run it with tensor_parallel_size 1")
    for what, n in (("attention heads", a.num_heads), ("KV heads", a.num_kv_heads), ("intermediate_size", a.intermediate_size)):
        if n % world_size:
            raise ConfigError(f"tensor_parallel_size {world_size} does not divide the model's {what} ({n}); "
                              f"pick a size that divides {a.num_heads} heads, {a.num_kv_heads} KV heads and {a.intermediate_size} channels")


def shard_arch(a: ModelArch, world_size: int) -> ModelArch:
    """The shape one rank's shard has: its share of the heads and MLP channels (the vocabulary stays whole; the
    head's rows are `TensorParallelGroup.vocab_shard`)."""
    return dataclasses.replace(a, num_heads=a.num_heads // world_size, num_kv_heads=a.num_kv_heads // world_size,
                               intermediate_size=a.intermediate_size // world_size)


def shard_tensor(name: str, tensor, a: ModelArch, tp: TensorParallelGroup):
    """This rank's part of checkpoint tensor `name` (a Hugging Face name) of the whole model `a`."""
    if name.endswith((".qweight", ".qzeros", ".scales")):
        raise ConfigError("tensor parallelism is not built for AWQ checkpoints; load the model unsharded or quantize it "
                          "at load with --quantization int4")
    parts = name.removeprefix("model.").split(".")
    leaf, module = parts[-1], parts[-2] if len(parts) > 1 else ""
    if parts[0] == "lm_head":
        return vocab_rows(tensor, a.vocab_size, tp)
    if parts[0] != "layers" or leaf not in ("weight", "bias"):
        return tensor  # embeddings, norms: every rank holds them whole
    size = {"q": a.num_heads * a.head_dim, "kv": a.num_kv_heads * a.head_dim, "mlp": a.intermediate_size}
    if module in _COLUMN:
        start, n = tp.split(size[_COLUMN[module]], module)
        return _rows(tensor, start, n)
    if module in _ROW:
        if leaf == "bias":  # added once, after the partial sums meet
            return tensor if tp.rank == 0 else torch.zeros_like(tensor)
        start, n = tp.split(size[_ROW[module]], module)
        if isinstance(tensor, torch.Tensor):
            return tensor[:, start : start + n].contiguous()
        try:
            return narrow_cols(tensor, start, n)
        except ValueError as e:  # a quantized block would straddle two ranks
            raise ConfigError(f"{name}: {e}; pick another tensor_parallel_size") from None
    return tensor  # q_norm / k_norm: per head dimension, the same for every head


def shard_lora(module: str, a: torch.Tensor, b: torch.Tensor, arch: ModelArch, tp: TensorParallelGroup):
    """This rank's part of a LoRA pair (PEFT's A [r, in], B [out, r]) on `module` (a Hugging Face name) of the whole
    model `arch`. A column-parallel module's B loses the rows its weight loses; a row-parallel module's A loses the
    columns its weight loses, and B stays whole: each rank's x_s A_s^T B^T is then a partial sum, and the all-reduce
    the layer already runs adds them up to x A^T B^T, with no collective of its own."""
    size = {"q": arch.num_heads * arch.head_dim, "kv": arch.num_kv_heads * arch.head_dim, "mlp": arch.intermediate_size}
    if module == "lm_head":  # vocab-parallel: this rank's rows of the vocabulary, padded as the head's
        return a, vocab_rows(b, arch.vocab_size, tp)
    if module == "embed_tokens":  # every rank holds the embedding whole
        return a, b
    if module in _COLUMN:
        start, n = tp.split(size[_COLUMN[module]], module)
        return a, b[start : start + n].contiguous()
    if module in _ROW:
        start, n = tp.split(size[_ROW[module]], module)
        return a[:, start : start + n].contiguous(), b
    raise ValueError(f"no tensor-parallel split for a LoRA pair on {module!r}")


def vocab_rows(tensor, vocab: int, tp: TensorParallelGroup):
    """This rank's rows of an LM head (or of the embedding that is the head), zero-padded to an equal share."""
    n = tp.vocab_shard(vocab)
    start = tp.rank * n
    if not isinstance(tensor, torch.Tensor):
        if vocab % tp.world_size:
            raise ConfigError(f"a quantized LM head of {vocab} rows cannot be split evenly over {tp.world_size} ranks")
        return narrow_rows(tensor, start, n)
    rows = tensor[start : start + n]
    if rows.shape[0] < n:
        rows = torch.cat([rows, rows.new_zeros(n - rows.shape[0], *rows.shape[1:])])
    return rows.contiguous()


def _rows(tensor, start: int, n: int):
    if isinstance(tensor, torch.Tensor):
        return tensor[start : start + n].contiguous()
    return narrow_rows(tensor, start, n)
