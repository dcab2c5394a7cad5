"""Runs one scheduled step: lay out the flattened batch, run the model, sample, verify drafts.

Owns the device-side state: the model weights and the K/V block pool. Layout of a step: decode rows first,
then prefill chunks. A decode row is one query that attends through its sequence's block table up to its own
position: a plain decode is one row; a decode with k drafted tokens is 1 + k rows of the same table with
context lengths n, n + 1, ..., n + k (every K/V is written before attention reads, so each row sees the drafts
before it). So speculative verification needs no attention kernel of its own, and one target pass verifies
every sequence in the batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from sieve.config import EngineConfig
from sieve.device import available_memory_bytes
from sieve.kernels import cpu_ops
from sieve.layers.attention import AttentionMetadata, KVCacheLayer, QuantizedKVCacheLayer, build_metadata
from sieve.models.arch import ModelArch
from sieve.models.decoder import DecoderModel
from sieve.outputs import Logprob
from sieve.sampler import SamplerOutput, SamplingMetadata, logprobs_of, sample, sample_greedy
from sieve.scheduler import ScheduledSeq, SchedulerOutput
from sieve.sequence import Sequence
from sieve.spec.rejection import verify_deterministic, verify_with_q
from sieve.structured import GrammarCompiler, apply_bitmask

log = logging.getLogger("sieve")


@dataclass
class StepResult:
    """For each sequence whose step reached its end, in scheduled order: the tokens it emits (one, or with
    drafts the accepted ones and one more) and their logprob dicts; and prompt logprobs computed this step, as
    (sequence, index of the first prompt token they score, one dict per token)."""

    sampled: list[tuple[Sequence, list[int], list[dict[int, Logprob] | None]]]
    prompt_logprobs: list[tuple[Sequence, int, list[dict[int, Logprob]]]] = field(default_factory=list)
    mask_seconds: float = 0.0  # structured outputs: time spent computing and applying token masks
    num_masked_rows: int = 0
    # With keep_hidden (Medusa): per sampled sequence, the last hidden state of the row that produced its last token.
    hidden: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, arch: ModelArch, model: DecoderModel, dtype: torch.dtype, device: torch.device,
        eos_token_ids: tuple[int, ...], grammars: GrammarCompiler | None = None,
    ):
        self.config, self.arch, self.model, self.dtype, self.device = config, arch, model, dtype, device
        if config.batch_invariant:
            if device.type != "cpu":
                from sieve.config import ConfigError

                raise ConfigError("batch_invariant is built for the CPU kernels (bf16); on CUDA it is not implemented")
            natives = [m.native for m in model.modules() if getattr(m, "native", None) is not None and hasattr(m.native, "batch_invariant")]
            for native in natives:
                native.batch_invariant = True  # (the native layer loop holds the same objects)
            if dtype != torch.bfloat16:
                log.info("batch_invariant: %s activations already take one kernel per row at every batch size", dtype)
        self.grammars = grammars  # structured outputs: fills the token masks of constrained rows
        self.keep_hidden = False  # speculative heads draft from the hidden state of each sequence's last token
        self.eos_token_ids = eos_token_ids
        self.block_size = config.block_size
        self.kv_kind = config.kv_cache_dtype
        self.kv_dtype = {"auto": dtype, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[self.kv_kind]
        self.num_blocks = self._plan_num_blocks()
        shape = (2, arch.num_layers, self.num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_pool = torch.zeros(shape, dtype=self.kv_dtype, device=device)
        if self.kv_kind == "auto":
            self.caches = [KVCacheLayer(self.kv_pool[0, i], self.kv_pool[1, i]) for i in range(arch.num_layers)]
        elif self.kv_kind == "int8":
            self.kv_scales = torch.ones(shape[:-1], dtype=torch.float16, device=device)
            self.caches = [QuantizedKVCacheLayer(self.kv_pool[0, i], self.kv_pool[1, i], "int8", self.kv_scales[0, i],
                                                 self.kv_scales[1, i]) for i in range(arch.num_layers)]
        else:  # fp8: the checkpoint's per-layer scales where it has them, else calibrated by the engine at load
            scales = getattr(model, "kv_scales", {})
            self.caches = [QuantizedKVCacheLayer(
                self.kv_pool[0, i], self.kv_pool[1, i], "fp8",
                torch.tensor(float(scales.get((i, "k"), 1.0)), device=device),
                torch.tensor(float(scales.get((i, "v"), 1.0)), device=device),
                calibrate=(i, "k") not in scales) for i in range(arch.num_layers)]
        self.generator = torch.Generator(device=device).manual_seed(config.seed)
        if device.type == "cpu":
            cpu_ops()  # build the native kernels now, not inside the first request

    @property
    def kv_needs_calibration(self) -> bool:
        """FP8 KV layers whose scales are set by the first K/V they see (the engine feeds them fixed text)."""
        return any(getattr(c, "calibrate", False) for c in self.caches)

    @property
    def block_bytes(self) -> int:
        per_token = self.arch.kv_bytes_per_token(self.kv_dtype.itemsize)
        if self.kv_kind == "int8":  # a float16 scale per token, head, K and V
            per_token += 2 * self.arch.num_layers * self.arch.num_kv_heads * 2
        return per_token * self.block_size

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
        gain = ""
        if self.kv_kind != "auto":
            plain = self.arch.kv_bytes_per_token(self.dtype.itemsize) * self.block_size
            gain = f"; {plain / self.block_bytes:.2f}x the tokens {str(self.dtype).removeprefix('torch.')} would hold"
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s, %s%s)",
            num_blocks, self.block_size, num_blocks * self.block_size,
            num_blocks * self.block_bytes / 2**20, str(self.kv_dtype).removeprefix("torch."), source, gain,
        )
        if num_blocks == cap:
            log.info("KV cache capped at max_num_seqs x max_model_len; the budget would hold %d blocks", budget // self.block_bytes)
        return num_blocks

    def metadata(self, slots: list[int], decodes: list, prefills: list) -> AttentionMetadata:
        """The step's attention metadata, with a view per sliding window the model's layers use."""
        windows = tuple(w for w in self.arch.layer_windows if w is not None)
        return build_metadata(slots, decodes, prefills, self.block_size, self.device, windows)

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        # Decode rows first (a decode and its drafts), then prefill chunks.
        items = sorted(sched.scheduled, key=lambda s: not s.is_decode)
        input_ids, positions, slots = [], [], []
        bs = self.block_size
        decodes, prefills = [], []
        for item in items:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            row = len(input_ids)
            input_ids += seq.token_ids[start : start + item.num_real_tokens] + item.draft
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if item.is_decode:  # a decode and its drafts: rows of one table (the kernel walks it once for them all)
                table = table[: -(-end // bs)]
                decodes += [(table, p + 1) for p in range(start, end)]
            else:
                prefills.append((row, item.num_new_tokens, end, table))
        meta = self.metadata(slots, decodes, prefills)

        hidden = self.model(
            torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device), self.caches, meta
        )
        if sched.block_copies:  # forked choices take their own copy of a shared partial block, now written
            self._copy_blocks(sched.block_copies)
        # Rows to sample: the last token of each item that reaches its sequence's end (once more for each choice
        # forked from it, which samples from the same logits), and each drafted position after it, sampled as
        # if the drafts before it were already generated (`pending`).
        seqs, pending, sample_rows, groups, row, prompt_lps = [], [], [], [], 0, []
        for item in items:
            if item.seq.needs_prompt_logprobs:
                prompt_lps += self._prompt_logprobs(item, hidden, row)
            last = row + item.num_real_tokens - 1
            row += item.num_new_tokens
            if not item.samples:
                continue
            for seq in [item.seq, *item.forks]:
                first = len(seqs)
                for j in range(len(item.draft) + 1 if seq is item.seq else 1):
                    seqs.append(seq)
                    pending.append(item.draft[:j])
                    sample_rows.append(last + j)
                groups.append((seq, item if seq is item.seq else None, first))
        if not seqs:
            return StepResult([], prompt_lps)
        sampled_hidden = hidden[sample_rows]
        logits = self.model.compute_logits(sampled_hidden)
        mask_seconds, masked = self._apply_grammars(logits, groups) if any(s.grammar is not None for s in seqs) else (0.0, 0)
        with_q = any(item is not None and item.draft_probs is not None and not seq.params.greedy for seq, item, _ in groups)
        if SamplingMetadata.plain_greedy(seqs, pending):
            out, meta_s = sample_greedy(logits), None
        else:
            meta_s = SamplingMetadata.from_seqs(seqs, self.eos_token_ids, logits.shape[-1], self.device, pending)
            out = sample(logits, meta_s, self.generator, keep_probs=with_q)
        targets = out.token_ids.tolist()
        wanted = [s.params.logprobs for s in seqs]
        lp_dicts = _logprob_dicts(out, wanted)
        result = []
        for seq, item, first in groups:
            if item is None or not item.draft:
                result.append((seq, [targets[first]], [lp_dicts[first]]))
                continue
            k, target = len(item.draft), targets[first : first + len(item.draft) + 1]
            if item.draft_probs is not None and not seq.params.greedy:
                emitted = verify_with_q(item.draft, item.draft_probs, out.probs[first : first + k + 1], target,
                                        meta_s.seeds[first : first + k + 1], self.generator)
                n = seq.params.logprobs
                if emitted[-1] != target[len(emitted) - 1] and n is not None:  # a residual draw: report it, not the target's
                    i = first + len(emitted) - 1
                    chosen = torch.tensor([emitted[-1]], device=self.device)
                    lp_dicts[i] = _logprob_dicts(logprobs_of(out.raw_logprobs[i : i + 1], chosen, n), [n])[0]
            else:
                emitted = verify_deterministic(item.draft, target)
            result.append((seq, emitted, lp_dicts[first : first + len(emitted)]))
        kept = []
        if self.keep_hidden:  # the row that sampled each sequence's last emitted token
            last = [first + len(emitted) - 1 for (_, item, first), (_, emitted, _) in zip(groups, result)]
            rows = sampled_hidden.index_select(0, torch.tensor(last, device=self.device))
            kept = [(seq, rows[i]) for i, (seq, _, _) in enumerate(result)]
        return StepResult(result, prompt_lps, mask_seconds, masked, kept)

    def _apply_grammars(self, logits: torch.Tensor, groups: list) -> tuple[float, int]:
        """Structured outputs: forbid, in each constrained row, every token its grammar does not allow next (a
        drafted row: after the drafts before it). Returns the time it took and the rows masked."""
        started = time.perf_counter()
        fills, rows = [], []
        for seq, item, first in groups:
            if seq.grammar is not None:
                draft = item.draft if item is not None else []
                fills.append((seq.grammar, first, draft))
                rows += range(first, first + len(draft) + 1)
        mask = self.grammars.fill_bitmask(fills, logits.shape[0])
        apply_bitmask(logits, mask, rows)
        return time.perf_counter() - started, len(rows)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        pool = self.kv_pool.view(torch.uint8)  # byte view: float8 has no CPU copy kernels everywhere
        pool[:, :, dst] = pool[:, :, src]
        if self.kv_kind == "int8":
            self.kv_scales[:, :, dst] = self.kv_scales[:, :, src]

    def _prompt_logprobs(self, item: ScheduledSeq, hidden: torch.Tensor, row: int, rows_per_pass: int = 256) -> list:
        """Logprobs of the prompt tokens this chunk predicts: the logits at position p score token p + 1.
        Computed from the rows of positions not scored yet (a chunk after preemption may have scored them),
        `rows_per_pass` at a time so a long prompt never holds [prompt, vocab] logits at once."""
        seq = item.seq
        start = seq.num_computed_tokens
        lo = max(start, len(seq.request.prompt_logprobs) - 1)
        hi = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
        n = seq.params.prompt_logprobs
        dicts = []
        for a in range(lo, hi, rows_per_pass):
            b = min(a + rows_per_pass, hi)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[row + a - start : row + b - start]), dim=-1)
            targets = torch.tensor(seq.token_ids[a + 1 : b + 1], device=self.device)
            dicts += _logprob_dicts(logprobs_of(logprobs, targets, n), [n] * (b - a))
        return [(seq, lo + 1, dicts)] if dicts else []


@torch.inference_mode()
def score_logits(runner: ModelRunner, token_ids: list[int], start: int, end: int, block_table: list[int]) -> torch.Tensor:
    """Float32 logits [end - start, vocab] for positions start..end-1 of one sequence whose tokens
    before `start` are already in `block_table` (same cache writes and reads as serving, so a
    quantized KV cache counts)."""
    return runner.model.compute_logits(score_hidden(runner, token_ids, start, end, block_table))


@torch.inference_mode()
def score_hidden(runner: ModelRunner, token_ids: list[int], start: int, end: int, block_table: list[int]) -> torch.Tensor:
    """The last hidden states [end - start, hidden] that `score_logits` turns into logits."""
    bs, dev = runner.block_size, runner.device
    slots = [block_table[p // bs] * bs + p % bs for p in range(start, end)]
    meta = runner.metadata(slots, [], [(0, end - start, end, block_table)])
    return runner.model(torch.tensor(token_ids[start:end], device=dev), torch.arange(start, end, device=dev), runner.caches, meta)


@torch.inference_mode()
def time_decode_rows(runner: ModelRunner, num_rows: int, block: int) -> float:
    """Seconds for one step of `num_rows` decode rows (forward, logits, argmax), every row on the borrowed
    `block` at position 0: the shape of the rows speculation adds, for the step-cost model."""
    dev = runner.device
    meta = runner.metadata([block * runner.block_size] * num_rows, [([block], 1)] * num_rows, [])
    ids = torch.zeros(num_rows, dtype=torch.int64, device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    hidden = runner.model(ids, torch.zeros_like(ids), runner.caches, meta)
    runner.model.compute_logits(hidden).max(dim=-1).indices.tolist()
    return time.perf_counter() - t0


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
