"""The engine's one entry to speculative decoding at load: `build_speculator` checks the target can take the
configured method, builds the proposer and the Speculator, and tells the runner which hidden states to keep."""

from __future__ import annotations

import logging

from sieve.config import ConfigError
from sieve.spec_decode.config import SpeculativeConfig
from sieve.spec_decode.speculator import Speculator, build_proposer

log = logging.getLogger("sieve")


def build_speculator(sc: SpeculativeConfig, arch, runner, device, dtype, max_len: int, max_num_batched_tokens: int,
                     make_engine, tpot_slo_ms: float | None = None, cost=None) -> Speculator:
    """`make_engine(model, quantization)`: the engine a draft model runs in; `tpot_slo_ms`: the TPOT SLO "auto" keeps
    every running sequence within; `cost`: the engine's step-cost model (sieve/step_cost.py)."""
    if sc.num_branches > 1 and (arch.has_sliding_layers or arch.mamba_layers):
        raise ConfigError("speculative_config.num_branches > 1 takes a model whose layers all attend to the full "
                          "context: a draft branch copies its sequence's partial block of one KV-cache group, and a "
                          "recurrent state cannot branch")
    try:
        proposer = build_proposer(sc, make_engine=make_engine, hidden_size=arch.hidden_size, vocab_size=arch.vocab_size,
                                  device=device, dtype=dtype, embed=runner.model.embed)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    speculator = Speculator(sc, proposer, max_len, max_num_batched_tokens, tpot_slo_ms / 1e3 if tpot_slo_ms else None, cost)
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
