"""The engine's one entry to speculative decoding at load: `build_speculator` checks the target can take the
configured method, builds the proposer and the Speculator, tells the runner which hidden states to keep, and
seeds adaptive depth's step-cost model by timing decode steps on this machine (`calibrate_step_cost`)."""

from __future__ import annotations

import logging
import statistics

from sieve.config import ConfigError
from sieve.spec_decode.config import SpeculativeConfig
from sieve.spec_decode.speculator import Speculator, build_proposer

log = logging.getLogger("sieve")


def build_speculator(sc: SpeculativeConfig, arch, runner, device, dtype, max_len: int, max_num_batched_tokens: int,
                     make_engine, tpot_slo_ms: float | None = None) -> Speculator:
    """`make_engine(model, quantization)`: the engine a draft model runs in; `tpot_slo_ms`: the TPOT SLO "auto" keeps
    every running sequence within."""
    if sc.num_branches > 1 and (arch.has_sliding_layers or arch.mamba_layers):
        raise ConfigError("speculative_config.num_branches > 1 takes a model whose layers all attend to the full "
                          "context: a draft branch copies its sequence's partial block of one KV-cache group, and a "
                          "recurrent state cannot branch")
    try:
        proposer = build_proposer(sc, make_engine=make_engine, hidden_size=arch.hidden_size, vocab_size=arch.vocab_size,
                                  device=device, dtype=dtype, embed=runner.model.embed)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    speculator = Speculator(sc, proposer, max_len, max_num_batched_tokens, tpot_slo_ms / 1e3 if tpot_slo_ms else None)
    aux = speculator.aux_hidden_layers
    if not all(0 <= layer < arch.num_layers for layer in aux):
        raise ConfigError(f"the EAGLE layer at {sc.model} reads the target's layers {list(aux)}, and the target "
                          f"has {arch.num_layers}")
    if aux and runner.model.tp is not None:
        raise ConfigError("an EAGLE-3 layer reads the target's inner layers, which tensor parallelism does not gather")
    runner.keep_hidden_states(speculator.needs_hidden, aux)
    log.info("speculative decoding: %s, %s draft tokens%s", sc.method,
             f"auto (up to {sc.max_k})" if sc.auto else sc.num_speculative_tokens,
             f", draft trees of {sc.num_branches} chains" if sc.num_branches > 1 else "")
    return speculator


def calibrate_step_cost(speculator: Speculator, runner, config, multi_group: bool, free_tokens: int, borrowed_blocks,
                        reps: int = 5) -> None:
    """Seed the step-cost model of adaptive speculation: time decode steps of every row count up to the
    model's exact range (where kernels that take rows in groups make the cost a staircase), then of 64, 128,
    256 rows, on this machine, before any request. Every real step refines it afterwards.

    Untimed steps first (first calls allocate, compile and fill caches), then `reps` rounds over every count,
    the median of each: a machine that speeds up or slows down while it runs shifts every count alike, where
    timing one count's repeats after another's would give the first counts the slow start. `borrowed_blocks(n)`:
    block tables for n tokens, lent from the engine's free pool; `multi_group`: the model's layers keep windows or
    recurrent state (no single context to time the keys' cost at: it stays 0)."""
    from sieve.model_runner import time_decode_rows

    cap = min(config.max_num_batched_tokens, 4 * config.max_num_seqs, 256)
    rows = speculator.calibration_rows(cap)
    with borrowed_blocks(1) as tables:
        for n in (rows[0], rows[-1], rows[0]):
            time_decode_rows(runner, n, tables)
        times = {n: [] for n in rows}
        for _ in range(reps):
            for n in rows:
                times[n].append(time_decode_rows(runner, n, tables))
        for n in rows:
            speculator.observe_step(n, statistics.median(times[n]), n)
    # Then the same rows over a long context: what a drafted row's attention to its sequence adds.
    if multi_group:
        return
    counts = sorted({min(r, cap) for r in (8, 16, 32)})  # one sequence's engine (cap 4) too
    # the rows' positions run to context + the most rows: within the model's length and the free blocks
    context = min(512, config.max_model_len // 2, free_tokens // 2, config.max_model_len - counts[-1], free_tokens - counts[-1])
    if context < 2 * config.block_size:
        return
    with borrowed_blocks(context + counts[-1]) as tables:  # each long step beside a short one: their difference
        for n in counts:  # one sequence's n rows from `context`, against n rows at position 0
            extra = [time_decode_rows(runner, n, tables, context) - time_decode_rows(runner, n, tables) for _ in range(reps)]
            speculator.observe_keys(n, n * context + n * (n - 1) // 2, statistics.median(extra))
