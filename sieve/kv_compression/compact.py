"""Compressing one sequence after its prompt's prefill: the press chooses, layer by layer, the positions each KV head
keeps; the block manager gives the sequence a shorter table; the model runner writes the kept K/V there, compactly.

After it the sequence has `kv_dropped` fewer slots than positions in the full-attention layers: a new token at
position p goes to slot p - kv_dropped and attends to every slot before it, while its rotary position stays p. Kept
keys were rotated at their own positions, so attention over the kept set is exact for that set. Sliding-window layers
(Gemma 3's local ones) are not pressed: their window already bounds their cache, and their slots stay positions.
With entropy budgets the layers keep different counts: the kept positions fill `kv_cells.num_blocks` blocks, each
layer's in blocks of its own and of planes the others leave free (cells.py), and kv_dropped is what lies before the
first block after them.

The prompt's exact blocks are not overwritten where the pool has room: they stay in the prefix cache for requests
that share the prompt, and the compacted copy is the sequence's own, never entered in the cache.
"""

from __future__ import annotations

import logging
import time

import torch

from sieve.kv_compression import KVCompression
from sieve.kv_compression.budgets import WINDOW, attention_entropy, layer_blocks, load_profile
from sieve.kv_compression.cells import LayerCells
from sieve.kv_compression.press import LayerKV
from sieve.kv_compression.query_stats import QueryStats

log = logging.getLogger("sieve")


def kept_positions(runner, seq, spec: KVCompression, profile: list[float] | None = None) -> list[torch.Tensor] | None:
    """Per attention layer, [KVH, n_kept] ascending prompt positions the press keeps (n_kept the same in every layer,
    or with entropy budgets each layer's share, whole blocks, by `profile`'s entropies or the prompt's own); None when
    it keeps them all (a prompt shorter than the
    press can score, or a ratio that rounds to nothing removed)."""
    T = seq.num_prompt_tokens
    press = spec.make()
    n_kept = spec.n_kept(T)
    entropy = spec.budgets == "entropy"
    window = press.query_window or (WINDOW if entropy and profile is None else 0)
    if n_kept >= T or T < max(press.min_prompt(), window + 1, 2 * runner.block_size if entropy else 0):
        return None
    table = seq.block_table
    queries = runner.window_queries(seq.token_ids, T, seq, window) if window else None
    stats = rotation = None
    if press.query_stats_from is not None:
        stats = seq.query_stats
        for start, end in stats.missing(T):  # positions taken from the prefix cache: a pass that writes nothing
            runner.tap_queries(seq.token_ids, start, end, seq, stats)
            stats.take(start, end)
        rotation = runner.future_rotation(T, press.future_positions)

    def layer_kv(j: int, layer: int) -> LayerKV:
        k, v = runner.prompt_kv(layer, table, T)
        kv = LayerKV(k, v, queries[j] if queries is not None and press.query_window else None, runner.attention_scale(layer), j)
        if stats is not None:
            kv.query_mean, kv.query_cov = stats.moments(layer)
            kv.future_rotation = rotation
        return kv

    layers = runner.attention_layers
    counts = [n_kept] * len(layers)
    if entropy:  # a first pass over the layers for their entropies, then each keeps its share
        entropies = profile or [attention_entropy(LayerKV(*runner.prompt_kv(layer, table, T), queries[j],
                                                          runner.attention_scale(layer), j)) for j, layer in enumerate(layers)]
        counts = [b * runner.block_size for b in layer_blocks(entropies, n_kept, T, runner.block_size)]
    return [press.keep(layer_kv(j, layer), n) for j, (layer, n) in enumerate(zip(layers, counts))]


@torch.inference_mode()
def compress_sequence(runner, blocks, seq, spec: KVCompression, profile: list[float] | None = None) -> bool:
    """Apply `spec` to `seq`, whose prompt is computed (and nothing after it). False when the pool has no room for
    the compacted copy and the prompt's own blocks are shared (it stays uncompressed; the caller counts it)."""
    kept = kept_positions(runner, seq, spec, profile)
    seq.kv_compressed = True
    if seq.query_stats is not None:  # (a sequence preempted later gathers them again as its prompt is computed)
        seq.query_stats.clear()
    if kept is None:
        return True
    counts = [k.shape[1] for k in kept]
    cells = LayerCells.packed(counts, runner.block_size) if spec.budgets == "entropy" else None
    moved = blocks.compact(seq, cells.num_blocks * runner.block_size if cells else counts[0])
    if moved is None:
        return False
    old_table, new_table = moved
    if cells is None:
        runner.compact_kv(old_table, new_table, kept)
        seq.kv_dropped = seq.num_prompt_tokens - counts[0]
    else:
        runner.compact_kv_cells(old_table, new_table, kept, cells)
        seq.kv_cells = cells
        seq.kv_dropped = seq.num_prompt_tokens - cells.num_blocks * runner.block_size
    return True


class KVCompressor:
    """The engine's side: which requests may be compressed (and the server's default for the rest), the press run
    after each step on every sequence whose prompt it completed, and the counters /metrics reads."""

    def __init__(self, default: str | None, arch, runner, blocks, tensor_parallel: bool, profile: str | None = None):
        self.default = KVCompression.of(default) if default else None
        self.profile = load_profile(profile) if profile is not None else None
        if self.profile is not None and len(self.profile) != len(runner.attention_layers):
            from sieve.config import ConfigError

            raise ConfigError(f"kv_budget_profile {profile!r} has {len(self.profile)} layers' entropies; this model "
                              f"has {len(runner.attention_layers)} attention layers")
        self.runner, self.blocks = runner, blocks
        self.refusal = self.unsupported(arch, tensor_parallel)
        self.sliding = arch.has_sliding_layers
        why = self.refusal or (self.budgets_refusal(self.default) if self.default is not None else None)
        if self.default is not None and why:
            from sieve.config import ConfigError

            raise ConfigError(f"kv_compression: {why}")
        self.num_requests = self.num_prompt_tokens = self.num_dropped_tokens = self.num_skipped = 0
        self.seconds = 0.0
        self.used = False  # a request has asked for a press (until then the per-step scan is skipped)

    @staticmethod
    def unsupported(arch, tensor_parallel: bool) -> str | None:
        """Why this model cannot be compressed (by name), or None."""
        if arch.is_mla:
            return "not built for multi-head latent attention (its cache holds latents, not per-head keys)"
        if not arch.full_layers:
            return "every attention layer slides: each one's window already bounds its cache"
        if arch.mamba_layers:
            return "not built for models with recurrent (Mamba-2) layers"
        if tensor_parallel:
            return "not built together with tensor parallelism yet"
        return None

    def budgets_refusal(self, spec: KVCompression) -> str | None:
        """Why `spec`'s budgets cannot run on this model, or None."""
        if spec.budgets == "entropy" and self.sliding:
            return ("entropy budgets are not built for models with sliding-window layers (their pool keeps one table "
                    "for the window layers)")
        return None

    def admit(self, params) -> None:
        """Give `params` (a request's own copy) the server's default where it asks for nothing and may take it;
        ValueError when it asks for compression this engine cannot give it."""
        kv = params.kv_transfer_params
        remote_decode = isinstance(kv, dict) and bool(kv.get("do_remote_decode"))
        if params.kv_compression is None and self.default is not None and params.n == 1 and not remote_decode:
            params.kv_compression = self.default
        if params.kv_compression is None:
            return
        why = self.refusal or self.budgets_refusal(params.kv_compression)
        if why:
            raise ValueError(f"kv_compression: {why}")
        if remote_decode:
            raise ValueError("kv_compression: a prefill server's request (kv_transfer_params.do_remote_decode) hands its "
                             "prompt's exact KV on; compress on the decode server")
        self.used = True

    @staticmethod
    def query_stats(params) -> QueryStats | None:
        """What a new sequence of `params` gathers during its prefill for its press (None: nothing)."""
        spec = params.kv_compression
        first = spec.make().query_stats_from if spec is not None else None
        return QueryStats(first) if first is not None else None

    def press_pending(self, running: list) -> list:
        """The press on every running sequence whose prompt is computed and not pressed yet (before the next step
        schedules it: its first token went out with the step that computed its prompt); returns the sequences it
        failed on (the caller ends them)."""
        failed = []
        if not self.used:  # the per-step path of an engine whose requests never ask for a press
            return failed
        for seq in list(running):
            if not seq.press_pending or seq.num_computed_tokens < seq.num_prompt_tokens or seq.finish_reason is not None:
                continue
            started = time.perf_counter()
            try:
                done = compress_sequence(self.runner, self.blocks, seq, seq.params.kv_compression, self.profile)
            except Exception:  # noqa: BLE001 - the request fails, the engine goes on
                log.exception("request %s: KV compression failed", seq.request.request_id)
                failed.append(seq)
                continue
            self.seconds += time.perf_counter() - started
            if not done:
                self.num_skipped += 1
                log.warning("request %s: KV compression skipped: no free blocks for the compacted copy and its prompt's "
                            "blocks are shared", seq.request.request_id)
            first = seq.request.kv_kept_tokens is None
            kept = seq.kv_cells.mean_kept if seq.kv_cells is not None else seq.num_prompt_tokens - seq.kv_dropped
            seq.request.kv_kept_tokens = kept
            if first:  # (a sequence preempted and pressed again counts once)
                self.num_requests += 1
                self.num_prompt_tokens += seq.num_prompt_tokens
                self.num_dropped_tokens += seq.num_prompt_tokens - kept
        return failed

    def snapshot(self):
        from sieve.stats import KVCompressionStats

        return KVCompressionStats(self.num_requests, self.num_prompt_tokens, self.num_dropped_tokens, self.num_skipped,
                                  self.seconds)
