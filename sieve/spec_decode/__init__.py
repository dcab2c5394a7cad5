"""Speculative decoding: proposers draft tokens, the target verifies them all in one ordinary step.

    SpeculativeConfig   the `speculative_config` (vLLM's fields)
    Speculator          what the engine drives: prepare drafts, record acceptance, finish a sequence
    build_proposer      one module per method: ngram.py, suffix.py, draft_model.py (behind proposer.Proposer)
    rejection           lossless verification: verify_deterministic (one-hot q), verify_with_q (rejection sampling)
    controller          the adaptive depth ("auto"), priced by the engine's step-cost model (sieve/step_cost.py)
"""

from sieve.spec_decode.config import SpeculativeConfig
from sieve.spec_decode.speculator import Speculator, SpecStats, build_proposer

__all__ = ["SpeculativeConfig", "Speculator", "SpecStats", "build_proposer"]
