"""Runs one scheduled step: lay out the flattened batch, run the model, sample.

Owns the device-side state: the model weights and the K/V block pool. Layout of a step:
decode tokens first (one row each, attended in one batched call), then prefill chunks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sieve.config import EngineConfig
from sieve.device import available_memory_bytes
from sieve.kernels import cpu_ops
from sieve.layers.attention import AttentionMetadata, KVCacheLayer, PrefillChunk
from sieve.models.arch import ModelArch
from sieve.models.decoder import DecoderModel
from sieve.outputs import Logprob
from sieve.sampler import SamplerOutput, SamplingMetadata, sample
from sieve.scheduler import ScheduledSeq, SchedulerOutput

log = logging.getLogger("sieve")


@dataclass
class StepResult:
    """Sampled tokens for the sequences whose step reached their end, in scheduled order."""

    sampled: list[tuple[ScheduledSeq, int, dict[int, Logprob] | None]]


class ModelRunner:
    def __init__(
        self, config: EngineConfig, arch: ModelArch, model: DecoderModel, dtype: torch.dtype, device: torch.device,
        eos_token_ids: tuple[int, ...],
    ):
        self.config, self.arch, self.model, self.dtype, self.device = config, arch, model, dtype, device
        self.eos_token_ids = eos_token_ids
        self.block_size = config.block_size
        self.kv_dtype = dtype
        self.num_blocks = self._plan_num_blocks()
        shape = (2, arch.num_layers, self.num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_pool = torch.zeros(shape, dtype=self.kv_dtype, device=device)
        self.caches = [KVCacheLayer(self.kv_pool[0, i], self.kv_pool[1, i]) for i in range(arch.num_layers)]
        self.generator = torch.Generator(device=device).manual_seed(config.seed)
        if device.type == "cpu":
            cpu_ops()  # build the native kernels now, not inside the first request

    @property
    def block_bytes(self) -> int:
        return self.arch.kv_bytes_per_token(self.kv_dtype.itemsize) * self.block_size

    def _plan_num_blocks(self) -> int:
        c = self.config
        if c.num_gpu_blocks_override is not None:
            return c.num_gpu_blocks_override
        if c.kv_cache_memory_gb is not None:
            budget = int(c.kv_cache_memory_gb * (1 << 30))
            source = f"--kv-cache-memory {c.kv_cache_memory_gb} GiB"
        else:
            # Free memory after the weights are loaded; a step's activations are not reserved yet,
            # which is why only a fraction is taken.
            budget = int(available_memory_bytes(self.device) * c.kv_cache_memory_fraction)
            source = f"{c.kv_cache_memory_fraction:.0%} of free memory"
        # Never more than enough for max_num_seqs sequences at full length (plus one spare each).
        cap = c.max_num_seqs * (-(-c.max_model_len // self.block_size) + 1)
        num_blocks = min(max(budget // self.block_bytes, 1), cap)
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s, %s)",
            num_blocks, self.block_size, num_blocks * self.block_size,
            num_blocks * self.block_bytes / 2**20, str(self.kv_dtype).removeprefix("torch."), source,
        )
        return num_blocks

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        # Decodes first, then prefill chunks (a decode is a 1-token step at the end of its sequence).
        items = sorted(sched.scheduled, key=lambda s: not (s.num_new_tokens == 1 and s.samples))
        input_ids, positions, slots = [], [], []
        bs = self.block_size
        decode_tables, decode_lens, prefills = [], [], []
        for item in items:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            row = len(input_ids)
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if item.num_new_tokens == 1 and item.samples:
                decode_tables.append(table[: -(-end // bs)])
                decode_lens.append(end)
            else:
                prefills.append(PrefillChunk(row, item.num_new_tokens, end, torch.tensor(table[: -(-end // bs)], device=self.device)))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_decodes=len(decode_tables),
            decode_block_tables=None,
            decode_context_lens=None,
            prefills=prefills,
        )
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], device=self.device)
            meta.decode_context_lens = torch.tensor(decode_lens, device=self.device)

        hidden = self.model(
            torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device), self.caches, meta
        )
        # Rows whose sequence reaches its end this step: the last token of each such item.
        sampling, last_rows, row = [], [], 0
        for item in items:
            row += item.num_new_tokens
            if item.samples:
                sampling.append(item)
                last_rows.append(row - 1)
        if not sampling:
            return StepResult([])
        logits = self.model.compute_logits(hidden[last_rows])
        meta_s = SamplingMetadata.from_seqs([s.seq for s in sampling], self.eos_token_ids, logits.shape[-1], self.device)
        out = sample(logits, meta_s, self.generator)
        return StepResult(list(zip(sampling, out.token_ids.tolist(), _logprob_dicts(out, [s.seq.params.logprobs for s in sampling]))))


def _logprob_dicts(out: SamplerOutput, wanted: list[int | None]) -> list[dict[int, Logprob] | None]:
    if out.logprobs is None:
        return [None] * len(wanted)
    chosen_ids, chosen_lp, ranks = out.token_ids.tolist(), out.logprobs.tolist(), out.ranks.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    result: list[dict[int, Logprob] | None] = []
    for i, n in enumerate(wanted):
        if n is None:
            result.append(None)
            continue
        d = {chosen_ids[i]: Logprob(chosen_lp[i], ranks[i])}
        for r in range(n):
            d.setdefault(top_ids[i][r], Logprob(top_lp[i][r], r + 1))
        result.append(d)
    return result
