"""Runs one scheduled step: lay out the flattened batch, run the model, sample, verify drafts.

Owns the device-side state: the model weights and the K/V block pool. Layout of a step: decode rows first,
then prefill chunks. A decode row is one query that attends through its sequence's block table up to its own
position: a plain decode is one row; a decode with k drafted tokens is 1 + k rows of the same table with
context lengths n, n + 1, ..., n + k (every K/V is written before attention reads, so each row sees the drafts
before it). So speculative verification needs no attention kernel of its own, and one target pass verifies
every sequence in the batch.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from sieve.config import EngineConfig
from sieve.decode_graph import StaticDecode, capture_sizes
from sieve.device import available_memory_bytes, zeroed
from sieve.kernels import cpu_ops
from sieve.block_manager import STATE_GROUP
from sieve.layers.attention import AttentionMetadata, KVCacheLayer, QuantizedKVCacheLayer, QueryTap, build_metadata
from sieve.layers.mamba import RecurrentMetadata, RecurrentState
from sieve.lora import LoRABatch
from sieve.models.arch import ModelArch
from sieve.models.decoder import DecoderModel
from sieve.outputs import Logprob
from sieve.sampler import SamplerOutput, SamplingMetadata, logprob_dicts, logprobs_of, sample, sample_greedy
from sieve.scheduler import ScheduledSeq, SchedulerOutput
from sieve.sequence import Sequence
from sieve.spec_decode.step import SampleGroup, SamplePlan, verify
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
    # With keep_hidden (speculative heads): (sequence, position of the first row, hidden states [rows, H]). "last"
    # (Medusa): per sampled sequence, the row that produced its last token; "all" (EAGLE): every row computed for
    # each scheduled sequence (drafted rows included: the proposer keeps only those below the committed tokens).
    hidden: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, arch: ModelArch, model: DecoderModel, dtype: torch.dtype, device: torch.device,
        eos_token_ids: tuple[int, ...], grammars: GrammarCompiler | None = None, num_blocks: tuple[int, int] | None = None,
    ):
        """`arch` is the shape of the model this process holds (one rank's shard under tensor parallelism), so the K/V
        pool holds its KV heads; `num_blocks` (full-attention, sliding-window group) fixes the pool's size instead of
        planning it (a tensor-parallel worker takes the driver's)."""
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
        if config.activation_quantization is not None:
            self._quantize_activations(model, device)
        self.grammars = grammars  # structured outputs: fills the token masks of constrained rows
        self.lora_slots = None  # CUDA: the step's adapters in slots, one launch each projection (sieve/lora/slots.py)
        self.keep_hidden: str | None = None  # speculative heads draft from hidden states: "last" or "all" rows (StepResult)
        # keep_hidden "all" with EAGLE-3's fused features: the residual stream after these layers is kept beside each
        # row's last hidden state ([rows, (1 + len) * hidden], the last hidden state first)
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.eos_token_ids = eos_token_ids
        self.block_size = config.block_size
        self.kv_kind = config.kv_cache_dtype
        self.kv_dtype = {"auto": dtype, "bfloat16": torch.bfloat16, "float16": torch.float16, "fp8": torch.float8_e4m3fn,
                         "int8": torch.int8}[self.kv_kind]
        # KV-cache groups: the full-attention layers, and the sliding-window layers' own pool (which gives back
        # blocks as they leave the window; see SlidingWindowBlockManager). Models without sliding layers: one group.
        self.layer_groups = [arch.full_layers, arch.sliding_layers] if arch.has_sliding_layers else [arch.full_layers]
        self.num_blocks, self.num_window_blocks = num_blocks if num_blocks is not None else self._plan_num_blocks()
        self.kv_pools, self.kv_scale_pools, self.caches = [], [], [None] * arch.num_layers
        # the capture-ready decode step (sieve/decode_graph.py), built by `prepare_static_decode`: its padded rows
        # write to a block past the ones the block manager hands out
        self.static_decode = None
        why_not = self._static_decode_refusal()
        self.pad_block = self.num_blocks if why_not is None else None
        if why_not and why_not != "off":
            log.info("decode steps run eagerly: %s", why_not)
        for layers, n in zip(self.layer_groups, (self.num_blocks + (self.pad_block is not None), self.num_window_blocks)):
            shape = (arch.kv_entries, len(layers), n, self.block_size, arch.num_kv_heads, arch.head_dim)
            pool = zeroed(shape, self.kv_dtype, device)
            scales = torch.ones(shape[:-1], dtype=torch.float16, device=device) if self.kv_kind == "int8" else None
            self.kv_pools.append(pool)
            self.kv_scale_pools.append(scales)
            for j, i in enumerate(layers):
                self.caches[i] = self._cache_layer(model, pool, scales, j, i)
                if layers is self.layer_groups[0] and not arch.is_mla:  # per-layer KV budgets read across the planes
                    self.caches[i].flat = _flat_view(self.caches[i], pool, scales)
        self.kv_pool = self.kv_pools[0]
        for i in arch.mamba_layers:  # a recurrent state per running sequence (slots from the block manager)
            self.caches[i] = RecurrentState(config.max_num_seqs, arch.mamba_conv_dim, arch.mamba_d_conv, arch.mamba_n_heads,
                                            arch.mamba_d_head, arch.mamba_d_state, device)
        if arch.mamba_layers:
            log.info("recurrent state: %d slots x %.1f KiB (%d Mamba-2 layers)", config.max_num_seqs,
                     arch.state_bytes_per_sequence() / 1024, len(arch.mamba_layers))
        self.generator = torch.Generator(device=device).manual_seed(config.seed)
        if device.type == "cpu":
            cpu_ops()  # build the native kernels now, not inside the first request

    def _static_decode_refusal(self) -> str | None:
        """None where decode steps can take the capture-ready path; else "off" (not asked for: `enforce_eager` on CUDA,
        the CPU's default) or why this model cannot."""
        c, a = self.config, self.arch
        if self.device.type != "cuda" and (c.cuda_graph_sizes is not None or c.enforce_eager) and not c.static_decode_on_cpu:
            log.info("cuda_graph_sizes / enforce_eager: CUDA graphs are a GPU's; this engine runs on %s, eagerly", self.device)
        if c.enforce_eager if self.device.type == "cuda" else not c.static_decode_on_cpu:
            return "off"
        if self.model.tp is not None:
            return "tensor parallelism announces each step to the other ranks"
        if a.has_sliding_layers or a.has_recurrent_state or a.is_mla or a.is_moe:
            return ("sliding-window, Mamba-2, latent-attention and mixture-of-experts layers are not in the capture-ready "
                    "step (expert routing reads its counts back to the host)")
        if self.device.type == "cuda" and self.kv_kind in ("fp8", "int8"):
            return "a quantized KV cache's CUDA decode path gathers whole block tables"
        return None

    def prepare_static_decode(self, max_rows: int) -> None:
        """Decode steps of up to `max_rows` rows through static buffers and batch-size buckets (sieve/decode_graph.py),
        captured in CUDA graphs on a GPU. Called once the context length is final (block tables are that wide) and any
        FP8 KV scales are calibrated. A no-op where `_static_decode_refusal` says no."""
        if self.pad_block is None:
            return
        sizes = capture_sizes(max_rows, self.config.cuda_graph_sizes)
        max_blocks = -(-(self.config.max_model_len + 1) // self.block_size) + 1

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            return self.model(input_ids, positions, self.caches, meta)

        self.static_decode = StaticDecode(forward, self.device, sizes, max_blocks, self.pad_block, self.block_size)
        if self.device.type == "cuda":
            with torch.inference_mode():
                self.static_decode.capture()
        else:
            log.info("decode steps run through static buffers padded to %d buckets (%s rows), eagerly: the CPU's check of "
                     "the path CUDA graphs capture", len(sizes), ", ".join(map(str, sizes)))

    @staticmethod
    def _quantize_activations(model: DecoderModel, device: torch.device) -> None:
        """activation_quantization="int8": every int4 linear's native kernel multiplies int8 activations."""
        from sieve.config import ConfigError

        ops = cpu_ops() if device.type == "cpu" else None
        natives = [m.native for m in model.modules() if getattr(m, "native", None) is not None and hasattr(m.native, "q8_activations")]
        int4 = [n for n in natives if ops is not None and n.kind == ops.LINEAR_INT4]
        if ops is None or not hasattr(ops, "qmatmul_int4"):
            raise ConfigError("activation_quantization int8 is built for sieve's CPU kernels (AVX2); this device or CPU build has none")
        if not int4:
            raise ConfigError("activation_quantization int8 takes int4 weights (a GGUF Q4_0/Q4_1 file, --quantization int4 or awq); "
                              "this model has no int4 linear layer")
        bad = [n for n in int4 if n.group % 32]
        if bad:
            raise ConfigError(f"activation_quantization int8 takes weight groups of a multiple of 32 inputs, got {bad[0].group}")
        for native in int4:
            native.q8_activations = True  # (the native layer loop holds the same objects)
        log.info("activation_quantization int8: %d of %d linear layers (the int4 ones) multiply int8 activations", len(int4), len(natives))

    def _cache_layer(self, model: DecoderModel, pool: torch.Tensor, scales: torch.Tensor | None, j: int, layer: int) -> KVCacheLayer:
        """Layer `layer`'s view of its group's pool, where it is the group's j-th layer. Multi-head latent attention
        caches one tensor, read as both K and V."""
        if self.arch.is_mla:
            if self.kv_kind in ("fp8", "int8"):
                from sieve.config import ConfigError

                raise ConfigError("a quantized KV cache (kv_cache_dtype fp8/int8) is not built for multi-head latent attention")
            return KVCacheLayer(pool[0, j], pool[0, j])
        if self.kv_kind not in ("fp8", "int8"):  # the model dtype, or a 16-bit float one (written rounded, read widened)
            return KVCacheLayer(pool[0, j], pool[1, j])
        if self.kv_kind == "int8":
            return QuantizedKVCacheLayer(pool[0, j], pool[1, j], "int8", scales[0, j], scales[1, j])
        # fp8: the checkpoint's per-layer scales where it has them, else calibrated by the engine at load
        ckpt = getattr(model, "kv_scales", {})
        return QuantizedKVCacheLayer(pool[0, j], pool[1, j], "fp8", torch.tensor(float(ckpt.get((layer, "k"), 1.0)), device=self.device),
                                     torch.tensor(float(ckpt.get((layer, "v"), 1.0)), device=self.device),
                                     calibrate=(layer, "k") not in ckpt)

    @property
    def kv_needs_calibration(self) -> bool:
        """FP8 KV layers whose scales are set by the first K/V they see (the engine feeds them fixed text)."""
        return any(getattr(c, "calibrate", False) for c in self.caches)

    def _layer_token_bytes(self, itemsize: int, scales: bool) -> int:
        """Bytes one token takes in one attention layer's cache (int8 KV: plus a float16 scale per head, K and V)."""
        return self.arch.kv_entries * self.arch.num_kv_heads * (self.arch.head_dim * itemsize + (2 if scales else 0))

    def group_block_bytes(self, group: int) -> int:
        """Bytes of one block of a KV-cache group (all its layers)."""
        if group >= len(self.layer_groups):
            return 0
        per_layer_token = self._layer_token_bytes(self.kv_dtype.itemsize, self.kv_kind == "int8")
        return per_layer_token * len(self.layer_groups[group]) * self.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the full-attention group (every attention layer of a model without sliding layers)."""
        return self.group_block_bytes(0)

    def window_blocks_needed(self) -> int:
        """Window-group blocks that let every running sequence hold its window and the step's tokens at once."""
        c, bs = self.config, self.block_size
        return c.max_num_seqs * (-(-(self.arch.max_window - 1) // bs) + 2) + -(-c.max_num_batched_tokens // bs)

    def _plan_num_blocks(self) -> tuple[int, int]:
        """Blocks of the full-attention group and of the sliding-window group (0 without sliding layers). The window
        group is planned first, with what lets every sequence keep its window (never more blocks than the full group
        gets); the rest of the budget goes to the full group, whose blocks bound the context."""
        c = self.config
        sliding = len(self.layer_groups) > 1
        if c.num_gpu_blocks_override is not None:
            n = c.num_gpu_blocks_override
            return n, min(n, self.window_blocks_needed()) if sliding else 0
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
        window = 0
        if sliding:
            wb = self.group_block_bytes(1)
            window = min(self.window_blocks_needed(), cap, max(budget // (self.block_bytes + wb), 1))
            budget -= window * wb
            log.info("KV cache, sliding-window layers (%d of %d, window %d): %d blocks x %d tokens (%.1f MiB)",
                     len(self.layer_groups[1]), self.arch.num_layers, self.arch.max_window, window, self.block_size,
                     window * wb / 2**20)
        if not self.block_bytes:  # every layer slides: the full group only counts positions
            return cap, window
        num_blocks = min(max(budget // self.block_bytes, 1), cap)
        gain = ""
        if self.kv_kind != "auto":
            plain = self._layer_token_bytes(self.dtype.itemsize, False) / self._layer_token_bytes(self.kv_dtype.itemsize, self.kv_kind == "int8")
            gain = f"; {plain:.2f}x the tokens {str(self.dtype).removeprefix('torch.')} would hold"
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s, %s%s)",
            num_blocks, self.block_size, num_blocks * self.block_size,
            num_blocks * self.block_bytes / 2**20, str(self.kv_dtype).removeprefix("torch."), source, gain,
        )
        if num_blocks == cap:
            log.info("KV cache capped at max_num_seqs x max_model_len; the budget would hold %d blocks", budget // self.block_bytes)
        return num_blocks, window

    def metadata(self, writes: list[tuple], decodes: list[tuple], prefills: list[tuple],
                 window_rows: tuple[list, list, list] | None = None) -> AttentionMetadata:
        """A step's attention metadata from what holds the tables (a Sequence, or anything with its `block_table`
        and `window.table`): `writes` (holder, first, end) for the slots whose K/V the step writes;
        `decodes` (holder, context length, table blocks) per decode row; `prefills` (first row, query length,
        context length, holder) per chunk. Sliding-window layers get their windows' views of `window.table`, from
        `window_rows` (the same three in that group's slots) where its slots differ from the full group's (a
        compressed sequence's: the press drops positions from the full-attention layers only)."""
        def group(table_of, windows: tuple[int, ...]) -> AttentionMetadata:
            slots, rows = self._slots_and_rows(table_of, writes, decodes)
            chunks = [(row, n, ctx, table_of(holder)) for row, n, ctx, holder in prefills]
            return build_metadata(slots, rows, chunks, self.block_size, self.device, windows)

        meta = group(lambda h: h.block_table, ())
        meta.layers = self._layer_views(meta, writes, decodes, prefills)
        if len(self.layer_groups) > 1:
            writes, decodes, prefills = window_rows or (writes, decodes, prefills)
            meta.windows = group(lambda h: h.window.table, tuple(w for w in self.arch.layer_windows if w is not None)).windows
        if self.arch.mamba_layers:  # which state slot each row continues; a sequence at position 0 starts from zeros
            fresh = [holder.state_slot for holder, start, _ in writes if start == 0]
            if fresh:
                slots = torch.tensor(fresh, dtype=torch.int64, device=self.device)
                for i in self.arch.mamba_layers:
                    self.caches[i].reset(slots)
            meta.recurrent = RecurrentMetadata(
                torch.tensor([h.state_slot for h, _, _ in decodes], dtype=torch.int64, device=self.device) if decodes else None,
                [(row, n, holder.state_slot) for row, n, _, holder in prefills])
        return meta

    def _layer_views(self, meta: AttentionMetadata, writes: list[tuple], decodes: list[tuple],
                     prefills: list[tuple]) -> dict[int, AttentionMetadata] | None:
        """Where a holder keeps per-layer budgets (`kv_cells`, sieve/kv_compression/cells.py), each full-attention
        layer's view of the step: every row's table over the pool flattened across planes, and each budgeted row's
        length in its layer's table; None where no holder does."""
        if all(getattr(h, "kv_cells", None) is None for h, _, _ in writes):
            return None
        bs, plane = self.block_size, self.kv_pools[0].shape[2]
        views = {}
        for a, layer in enumerate(self.layer_groups[0]):
            tables: dict[int, list[int]] = {}

            def table_of(h, a=a, tables=tables) -> list[int]:
                if id(h) not in tables:
                    cells = getattr(h, "kv_cells", None)
                    tables[id(h)] = cells.table(a, h.block_table, plane) if cells else [a * plane + b for b in h.block_table]
                return tables[id(h)]

            def length(h, slots: int, a=a) -> int:
                cells = getattr(h, "kv_cells", None)
                return cells.context(a, slots, bs) if cells else slots

            def blocks(h, nb: int, a=a) -> int:
                cells = getattr(h, "kv_cells", None)
                return cells.blocks(a, nb) if cells else nb

            rows = [(table_of(h)[: blocks(h, nb)], length(h, ctx)) for h, ctx, nb in decodes]
            chunks = [(row, n, length(h, ctx), table_of(h)) for row, n, ctx, h in prefills]
            view = build_metadata([], rows, chunks, bs, self.device)
            view.slot_mapping, view.flat = meta.slot_mapping, True
            views[layer] = view
        return views

    def _slots_and_rows(self, table_of, writes: list[tuple], decodes: list[tuple]) -> tuple[list[int], list[tuple[list[int], int]]]:
        """The cache slots `writes` write, and each decode row's (block table, context length), from the tables
        `table_of(holder)` gives; a holder's rows share one slice of its table (the decode kernel walks a sequence's
        K/V once for them)."""
        bs = self.block_size
        slots = []
        for holder, start, end in writes:
            table = table_of(holder)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        tables, rows = {}, []
        for holder, ctx, nb in decodes:
            key = (id(holder), nb)
            if key not in tables:
                tables[key] = table_of(holder)[:nb]
            rows.append((tables[key], ctx))
        return slots, rows

    def forward_decodes(self, input_ids: list[int], positions: list[int], writes: list[tuple], decodes: list[tuple]) -> torch.Tensor:
        """Final hidden states of a decode-only step (`writes` and `decodes` as for `metadata`; one group of full-attention
        layers): through the capture-ready path where it fits the step, else eagerly."""
        if self.static_decode is not None and all(getattr(h, "kv_cells", None) is None for h, _, _ in writes):
            slots, rows = self._slots_and_rows(lambda h: h.block_table, writes, decodes)
            if self.static_decode.fits(len(rows), max(len(t) for t, _ in rows)):
                hidden = self.static_decode.run(input_ids, positions, slots, [t for t, _ in rows], [c for _, c in rows])
                return hidden.clone() if self.keep_hidden is not None else hidden  # kept past the next replay
        meta = self.metadata(writes, decodes, [])
        return self.model(torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
                          self.caches, meta)

    # ---- one step --------------------------------------------------------------------------
    def keep_hidden_states(self, mode: str | None, aux_layers: tuple[int, ...] = ()) -> None:
        """What a speculative proposer drafts from: the hidden state of each sequence's "last" row, or of "all" its rows
        (StepResult.hidden), with EAGLE-3's `aux_layers` (the residual stream after them beside the last hidden state);
        None: nothing kept."""
        if mode not in (None, "last", "all"):
            raise ValueError(f"keep_hidden_states: {mode!r} is not None, 'last' or 'all'")
        self.keep_hidden, self.aux_hidden_layers = mode, tuple(aux_layers)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """One step: lay the scheduled sequences out as one flat batch (decode rows first, grouped by LoRA adapter, a
        decode and its drafts together, then prefill chunks), run the model, sample, and verify whatever was drafted."""
        # decode rows first; among them, the rows of one LoRA adapter together (one run each, for its low-rank products)
        items = sorted(sched.scheduled, key=lambda s: (not s.is_decode, s.seq.request.lora.fingerprint if s.seq.request.lora else ""))
        input_ids, positions, rows, taps, adapters = self._layout(items)
        if sched.branch_copies:  # draft branches start from a copy of their sequence's partial last block
            self.copy_blocks(sched.branch_copies)
        aux_layers = self.aux_hidden_layers if self.keep_hidden == "all" else ()
        # decode-only steps take the capture-ready path (whose output a later step overwrites: a pooled embedding's
        # last row, which its pooler keeps, stays eager), the rest the eager one
        lora = None  # the step's adapters (LoRABatch), the head's rows among them
        if self.static_decode is not None and not aux_layers and not adapters and all(
                i.is_decode and i.seq.request.pooler is None for i in items):
            hidden = self.forward_decodes(input_ids, positions, *rows[0][:2])
        else:
            meta = self.metadata(*rows[0], rows[1]) if len(rows) > 1 else self.metadata(*rows[0])
            meta.query_taps = taps
            meta.lora = None
            if adapters:  # (on a CPU without slots, the two-argument call the tests watch)
                slots = (self.lora_slots,) if self.lora_slots is not None else ()
                meta.lora = lora = LoRABatch.of(adapters, self.device, *slots)
            hidden = self.model(torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
                                self.caches, meta, aux_layers)
        features = hidden
        if aux_layers:
            hidden, aux = hidden
            features = torch.cat([hidden, aux], dim=1)
        if sched.block_copies:  # forked choices take their own copy of a shared partial block, now written
            self.copy_blocks(sched.block_copies)
        plan, prompt_lps, first_rows = self._plan_samples(items, hidden, lora)
        if not plan.seqs:
            return StepResult([], prompt_lps, hidden=self._kept_hidden(first_rows, features))
        sampled_hidden = hidden[plan.rows]
        out, meta_s, mask_seconds, masked = self._sample(plan, sampled_hidden, lora.take(plan.rows) if lora else None)
        result, last_rows = verify(plan, out, meta_s.seeds if meta_s is not None else None, self.generator)
        kept = self._kept_hidden(first_rows, features)
        if self.keep_hidden == "last":  # the row that sampled each sequence's last emitted token, at its position
            rows = sampled_hidden.index_select(0, torch.tensor(last_rows, device=self.device))
            kept = [(seq, seq.num_tokens + len(emitted) - 2, rows[i: i + 1]) for i, (seq, emitted, _) in enumerate(result)]
        return StepResult(result, prompt_lps, mask_seconds, masked, kept)

    def _layout(self, items: list[ScheduledSeq]) -> tuple[list[int], list[int], list[tuple], list[QueryTap], list[tuple]]:
        """The step's token ids, positions, per KV-cache group the (writes, decodes, prefills) `metadata` takes, the
        query taps and the LoRA adapters' rows. A decode and its drafts are rows of one table (the kernel walks it
        once for them all); a draft tree's other chains follow as the last token again, then the chain, each in
        blocks of its own."""
        input_ids, positions, taps, adapters = [], [], [], []
        # per KV-cache group, (writes, decodes, prefills) in its slots: a token's slot is its position less what a
        # press dropped from that group (the full-attention layers'; sliding-window layers keep their window whole)
        rows = [([], [], []) for _ in self.layer_groups]
        for item in items:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            row = len(input_ids)
            if seq.request.lora is not None:  # its rows (and its draft chains', laid out below) run its adapter
                adapters.append((seq.request.lora, row, row + item.num_rows))
            input_ids += seq.token_ids[start : start + item.num_real_tokens] + item.draft
            positions += range(start, end)  # rotary positions; K/V slots are positions less what a press dropped
            for group, d in zip(rows, (seq.kv_dropped, 0)):
                self._lay_out_slots(group, item, row, start - d, end - d)
            if not item.is_decode and seq.query_stats is not None and seq.press_pending:  # its press's statistics
                taps += [QueryTap(row + a - start, b - a, seq.query_stats)
                         for a, b in seq.query_stats.take(start, min(end, seq.num_prompt_tokens))]
            for branch in item.branches:
                input_ids += seq.token_ids[start : start + 1] + branch.draft
                positions += range(start, start + branch.num_rows)
        return input_ids, positions, rows, taps, adapters

    def _lay_out_slots(self, group: tuple[list, list, list], item: ScheduledSeq, row: int, start: int, end: int) -> None:
        """Append `item`'s rows to one KV-cache group's (writes, decodes, prefills), its slots start .. end - 1 (a
        decode's draft chains after it, each in its own fork's slots)."""
        writes, decodes, prefills = group
        seq, bs = item.seq, self.block_size
        writes.append((seq, start, end))
        if not item.is_decode:
            prefills.append((row, item.num_new_tokens, end, seq))
            return
        decodes += [(seq, p + 1, -(-end // bs)) for p in range(start, end)]
        for branch in item.branches:
            b_end = start + branch.num_rows
            writes.append((branch, start, b_end))
            decodes += [(branch, p + 1, -(-b_end // bs)) for p in range(start, b_end)]

    def _plan_samples(self, items: list[ScheduledSeq], hidden: torch.Tensor, lora=None) -> tuple[SamplePlan, list, list]:
        """The rows to sample (the last token of each item that reaches its sequence's end, and its drafted
        positions: SamplePlan), the prompt logprobs asked for, and each item's first row (and its chains')."""
        plan, prompt_lps, first_rows, row = SamplePlan(), [], [], 0
        for item in items:
            if item.seq.needs_prompt_logprobs:
                prompt_lps += self._prompt_logprobs(item, hidden, row, lora)
            if item.seq.request.pooler is not None:  # embeddings: the prompt chunk's rows, pooled (its last token alone
                # is scheduled like a decode)
                item.seq.request.pooler.add(item.seq.num_computed_tokens, hidden[row: row + item.num_real_tokens])
            branch_rows = list(itertools.accumulate([b.num_rows for b in item.branches[:-1]], initial=row + item.num_new_tokens)) \
                if item.branches else []
            first_rows.append((item, row, branch_rows))
            if item.samples:
                plan.add(item, row + item.num_real_tokens - 1, branch_rows)
            row += item.num_rows
        return plan, prompt_lps, first_rows

    def _sample(self, plan: SamplePlan, sampled_hidden: torch.Tensor, head_lora=None):
        """(SamplerOutput, its SamplingMetadata or None, grammar mask seconds, rows masked). Plain greedy rows without
        a grammar take the raw argmax: their logits are never needed. `head_lora`: the adapters that change the head,
        over the sampled rows."""
        seqs, mask_seconds, masked, meta_s = plan.seqs, 0.0, 0, None
        grammars, plain = any(s.grammar is not None for s in seqs), SamplingMetadata.plain_greedy(seqs, plan.pending)
        if plain and not grammars:
            return SamplerOutput(self.model.greedy_tokens(sampled_hidden, head_lora), None, None, None, None), None, 0.0, 0
        logits = self.model.compute_logits(sampled_hidden, head_lora)
        if grammars:
            mask_seconds, masked = self._apply_grammars(logits, plan.groups)
        if plain:
            return sample_greedy(logits), None, mask_seconds, masked
        meta_s = SamplingMetadata.from_seqs(seqs, self.eos_token_ids, logits.shape[-1], self.device, plan.pending)
        return sample(logits, meta_s, self.generator, keep_probs=plan.with_draft_probs()), meta_s, mask_seconds, masked

    def _kept_hidden(self, first_rows: list, hidden: torch.Tensor) -> list:
        """keep_hidden "all": each scheduled sequence's rows (those of the draft chain verification kept)."""
        if self.keep_hidden != "all":
            return []
        kept = []
        for item, row, branch_rows in first_rows:
            if item.chosen_branch:
                row, n = branch_rows[item.chosen_branch - 1], item.branches[item.chosen_branch - 1].num_rows
            else:
                n = item.num_new_tokens
            kept += [(seq, item.seq.num_computed_tokens, hidden[row: row + n]) for seq in [item.seq, *item.forks]]
        return kept

    def _apply_grammars(self, logits: torch.Tensor, groups: list[SampleGroup]) -> tuple[float, int]:
        """Structured outputs: forbid, in each constrained row, every token its grammar does not allow next (a
        drafted row: after the drafts before it). Returns the time it took and the rows masked."""
        started = time.perf_counter()
        fills, rows = [], []
        for g in groups:
            if g.seq.grammar is not None:
                draft = g.item.draft if g.item is not None else []
                fills.append((g.seq.grammar, g.first, draft))
                rows += range(g.first, g.first + len(draft) + 1)
        mask = self.grammars.fill_bitmask(fills, logits.shape[0])
        apply_bitmask(logits, mask, rows)
        return time.perf_counter() - started, len(rows)

    def block_tensors(self, block: int, group: int = 0) -> list[torch.Tensor]:
        """Views of one block of a KV-cache group (0: the full-attention layers, 1: the sliding-window layers) in each
        of its layers: K/V [entries, layers, block_size, kv_heads, head_dim], and with an int8 KV cache its scales
        (what KV transfer and the KV tiers move)."""
        parts = [self.kv_pools[group][:, :, block]]
        if self.kv_scale_pools[group] is not None:
            parts.append(self.kv_scale_pools[group][:, :, block])
        return parts

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """(group, source, destination) block copies in every layer's pool (and recurrent state slots)."""
        if self.model.tp is not None:  # every rank copies its own heads' blocks
            self.model.tp.announce(("copy_blocks", copies))
        states = [c for c in copies if c[0] == STATE_GROUP]
        if states:  # forked choices take a copy of their sibling's recurrent state after the prompt
            src = torch.tensor([c[1] for c in states], device=self.device)
            dst = torch.tensor([c[2] for c in states], device=self.device)
            for i in self.arch.mamba_layers:
                self.caches[i].copy(src, dst)
        for group, (pool, scales) in enumerate(zip(self.kv_pools, self.kv_scale_pools)):
            mine = [c for c in copies if c[0] == group]
            if not mine:
                continue
            # One slice copy a block: an indexed copy along the pool's third dimension ran 25x slower on the CPU (5 ms
            # for a draft tree's 7 blocks in SmolLM2's 30 layers), and its index tensors cost the GPU a copy from the host.
            # A draft tree's chains all copy the same source block: its view is taken once.
            pool = pool.view(torch.uint8)  # byte view: float8 has no CPU copy kernels everywhere
            views: dict[int, tuple] = {}
            for _, src, dst in mine:
                if src not in views:
                    views[src] = (pool[:, :, src], scales[:, :, src] if scales is not None else None)
                pool_src, scales_src = views[src]
                pool[:, :, dst].copy_(pool_src)
                if scales is not None:
                    scales[:, :, dst].copy_(scales_src)

    # ---- KV compression (sieve/kv_compression) ---------------------------------------------
    @property
    def attention_layers(self) -> list[int]:
        """The layers a press compresses: the full-attention ones (a sliding-window layer's window already bounds its
        cache, and it keeps it whole; a model with recurrent layers is refused)."""
        return list(self.layer_groups[0])

    def attention_scale(self, layer: int) -> float:
        return self.model.layers[layer].attn.scale

    def prompt_kv(self, layer: int, table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V of the first `num_tokens` slots of `table`, float32 [KVH, T, D] (read as attention
        reads them: a quantized cache widened)."""
        blocks = torch.tensor(table[: -(-num_tokens // self.block_size)], dtype=torch.int64, device=self.device)
        k, v = self.caches[layer].read_kv(blocks, torch.float32)
        return k[:num_tokens].transpose(0, 1), v[:num_tokens].transpose(0, 1)

    @torch.inference_mode()
    def window_queries(self, token_ids: list[int], num_tokens: int, tables, window: int) -> list[torch.Tensor]:
        """Per attention layer a press compresses, the rotated queries [H, window, D] (float32) of positions
        num_tokens - window .. num_tokens - 1, whose K/V the holder `tables` (its `block_table`, and `window.table`
        where the model has sliding layers) holds with everything before them: those positions run again through the
        PyTorch layer loop, which keeps each full-attention layer's queries and writes nothing."""
        start = num_tokens - window
        meta = _passing(self.metadata([(tables, start, num_tokens)], [], [(0, window, num_tokens, tables)]))
        meta.capture = []
        meta.lora = self._adapter_rows(tables, window)
        self.model(torch.tensor(token_ids[start:num_tokens], device=self.device),
                   torch.arange(start, num_tokens, device=self.device), self.caches, meta)
        return [q.transpose(0, 1).float() for q in meta.capture]

    @torch.inference_mode()
    def tap_queries(self, token_ids: list[int], start: int, end: int, tables, sink, rows: int = 512) -> None:
        """Positions start .. end - 1, whose K/V the holder `tables` holds with everything before them (as for
        `window_queries`), run again through the PyTorch layer loop `rows` at a time, writing nothing; each
        full-attention layer hands their queries before rotation to `sink.add(layer, q)`."""
        for a in range(start, end, rows):
            b = min(a + rows, end)
            meta = _passing(self.metadata([(tables, a, b)], [], [(0, b - a, b, tables)]))
            meta.query_taps = [QueryTap(0, b - a, sink)]
            meta.lora = self._adapter_rows(tables, b - a)
            self.model(torch.tensor(token_ids[a:b], device=self.device), torch.arange(a, b, device=self.device),
                       self.caches, meta)

    def _adapter_rows(self, holder, rows: int) -> LoRABatch | None:
        """A pass's `rows` rows as the LoRA adapter of the holder's request runs them (None: the base model's), so that
        a press reads the queries the request's own steps compute."""
        adapter = getattr(getattr(holder, "request", None), "lora", None)
        if adapter is None:
            return None
        return LoRABatch.of([(adapter, 0, rows)], self.device, *((self.lora_slots,) if self.lora_slots is not None else ()))

    def future_rotation(self, first: int, count: int) -> torch.Tensor:
        """[D, D]: the rotary rotation of positions first .. first + count - 1, averaged (expected attention)."""
        return self.model.rotary.mean_rotation(first, count).to(self.device)

    def compact_kv(self, old_table: list[int], new_table: list[int], kept: list[torch.Tensor]) -> None:
        """Every attention layer's kept positions (`kept[j]` [KVH, n]: positions in `old_table`'s slots, per KV head)
        written to slots 0 .. n - 1 of `new_table`, head by head (gathered first: the tables may share blocks)."""
        bs, dev = self.block_size, self.device
        old = torch.tensor(old_table, dtype=torch.int64, device=dev)
        new = torch.tensor(new_table, dtype=torch.int64, device=dev)
        n = kept[0].shape[1]
        dst = new[torch.arange(n, device=dev) // bs] * bs + torch.arange(n, device=dev) % bs  # [n]
        heads = torch.arange(self.arch.num_kv_heads, device=dev)[:, None]
        for layer, positions in zip(self.attention_layers, kept):
            positions = positions.to(dev)
            src = old[positions // bs] * bs + positions % bs  # [KVH, n]
            cache = self.caches[layer]
            planes = [cache.k, cache.v] + ([cache.k_scale, cache.v_scale] if self.kv_kind == "int8" else [])
            for plane in planes:  # byte views: float8 has no CPU gather everywhere
                flat = plane.view(torch.uint8) if plane.dtype.itemsize == 1 else plane
                flat = flat.view(-1, *plane.shape[2:])  # [slots, KVH, ...]
                flat.index_copy_(0, dst, flat[src, heads].transpose(0, 1).contiguous())

    def compact_kv_cells(self, old_table: list[int], new_table: list[int], kept: list[torch.Tensor], cells) -> None:
        """As `compact_kv`, where each attention layer keeps its own count (`kept[a]` [KVH, n_a]) in the blocks
        `cells` (LayerCells) gives it, some in other layers' planes of `new_table`: every layer's kept K/V is gathered
        before any is written (a plane of a block the tables share may hold another layer's positions still to read)."""
        bs, dev, pool, scales = self.block_size, self.device, self.kv_pools[0], self.kv_scale_pools[0]
        old = torch.tensor(old_table, dtype=torch.int64, device=dev)
        heads = torch.arange(self.arch.num_kv_heads, device=dev)[:, None]
        planes = [pool[0], pool[1]] + ([scales[0], scales[1]] if scales is not None else [])
        flats = [(p.view(torch.uint8) if p.dtype.itemsize == 1 else p).reshape(-1, *p.shape[3:]) for p in planes]
        per_plane = pool.shape[2] * bs  # slots in one layer's plane
        gathered = []
        for a, positions in enumerate(kept):
            src = a * per_plane + old[positions.to(dev) // bs] * bs + positions.to(dev) % bs  # [KVH, n_a]
            gathered.append([f[src, heads].transpose(0, 1).contiguous() for f in flats])
        for a, rows in enumerate(gathered):
            blocks = torch.tensor(cells.table(a, new_table, pool.shape[2])[: len(cells.cells[a])], dtype=torch.int64, device=dev)
            n = torch.arange(rows[0].shape[0], device=dev)
            dst = blocks[n // bs] * bs + n % bs
            for f, x in zip(flats, rows):
                f.index_copy_(0, dst, x)

    def _prompt_logprobs(self, item: ScheduledSeq, hidden: torch.Tensor, row: int, lora=None, rows_per_pass: int = 256) -> list:
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
            rows = range(row + a - start, row + b - start)
            head = lora.take(rows) if lora is not None else None
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows.start : rows.stop], head), dim=-1)
            targets = torch.tensor(seq.token_ids[a + 1 : b + 1], device=self.device)
            dicts += logprob_dicts(logprobs_of(logprobs, targets, n), [n] * (b - a))
        return [(seq, lo + 1, dicts)] if dicts else []


def _flat_view(cache: KVCacheLayer, pool: torch.Tensor, scales: torch.Tensor | None) -> KVCacheLayer:
    """`cache` (a layer of the group `pool` holds) reading the whole pool flattened across its layers' planes (block
    b of plane a is block a x blocks + b), with the layer's own scales (fp8's per layer; int8's, beside the codes,
    flattened alike)."""
    flat = copy.copy(cache)
    layers, blocks = pool.shape[1], pool.shape[2]
    flat.k, flat.v = (pool[e].view(layers * blocks, *pool.shape[3:]) for e in (0, min(1, pool.shape[0] - 1)))
    if scales is not None:
        flat.k_scale, flat.v_scale = (scales[e].view(layers * blocks, *scales.shape[3:]) for e in (0, 1))
    flat.flat = None
    return flat


def _passing(meta: AttentionMetadata) -> AttentionMetadata:
    """`meta` (and its sliding windows' views) for a pass that writes no K/V."""
    for view in (meta, *meta.windows.values()):
        view.write_kv = False
    return meta


@torch.inference_mode()
def score_logits(runner: ModelRunner, token_ids: list[int], start: int, end: int, tables) -> torch.Tensor:
    """Float32 logits [end - start, vocab] for positions start..end-1 of one sequence whose tokens
    before `start` are already in the blocks of `tables` (its `block_table`, and `window.table` where the model
    has sliding layers; same cache writes and reads as serving, so a quantized KV cache counts)."""
    return runner.model.compute_logits(score_hidden(runner, token_ids, start, end, tables))


@torch.inference_mode()
def score_hidden(runner: ModelRunner, token_ids: list[int], start: int, end: int, tables,
                 aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
    """The last hidden states [end - start, hidden] that `score_logits` turns into logits; with `aux_layers`, the
    residual stream after those layers beside them ([end - start, (1 + len(aux_layers)) * hidden], as served to an
    EAGLE-3 layer)."""
    dev = runner.device
    meta = runner.metadata([(tables, start, end)], [], [(0, end - start, end, tables)])
    out = runner.model(torch.tensor(token_ids[start:end], device=dev), torch.arange(start, end, device=dev),
                       runner.caches, meta, tuple(aux_layers))
    return torch.cat(out, dim=1) if aux_layers else out


@torch.inference_mode()
def time_decode_rows(runner: ModelRunner, num_rows: int, tables, context: int = 0, logits: bool = True) -> float:
    """Seconds for one step of `num_rows` decode rows (forward, logits, argmax), for the step-cost model; without
    `logits`, the forward alone (what a prompt's tokens cost but its last: the KV tiers' price of recomputing).

    With `context` > 0 the rows are one sequence's decode and drafted rows, the shape speculation adds: positions
    `context` .. `context` + `num_rows` - 1 of the borrowed `tables` (which hold that many tokens), row i attending
    to its `context` + i + 1 keys, `num_rows` * `context` + `num_rows` * (`num_rows` - 1) / 2 more than the same
    rows at position 0. The attention kernels group consecutive positions of one table and read their keys once
    for all of them. The rows used to sit at one position, where each was a group of its own, and that priced a
    drafted row's keys at an independent sequence's: about twice what a 9-row verification pays on the Emerald
    Rapids host. With `context` 0 every row is at position 0 (one token of `tables`), attending to one key.
    The time includes building the rows' attention metadata, as a real step's does."""
    dev = runner.device
    end = context + num_rows if context else 1
    blocks = -(-end // runner.block_size)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    if context:
        writes, decodes = [(tables, context, end)], [(tables, p + 1, blocks) for p in range(context, end)]
        positions = list(range(context, end))
    else:
        writes, decodes, positions = [(tables, 0, 1)] * num_rows, [(tables, 1, blocks)] * num_rows, [0] * num_rows
    if len(runner.layer_groups) == 1 and not runner.arch.mamba_layers:
        hidden = runner.forward_decodes([0] * num_rows, positions, writes, decodes)
    else:
        meta = runner.metadata(writes, decodes, [])
        hidden = runner.model(torch.zeros(num_rows, dtype=torch.int64, device=dev), torch.tensor(positions, device=dev),
                              runner.caches, meta)
    if logits:
        runner.model.compute_logits(hidden).max(dim=-1).indices.tolist()
    elif dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0
