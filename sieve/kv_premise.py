"""Whether a quantized KV cache buys anything on this load. Its premise is that memory binds: an FP8 or int8 cache
holds about twice the tokens of a 16-bit one, so more sequences fit. Where the pool never comes near full, it only
costs quality (docs/quality.md) and the widening of its codes: the engine says so in the log, as speculation's
`auto` says when it steps aside. The cache's format is fixed at start-up (its blocks are sized by it), so it cannot
switch itself off; the log names the flag that does (`--kv-cache-dtype auto`)."""

from __future__ import annotations

import logging

log = logging.getLogger("sieve")

WINDOW_STEPS = 2000  # steps with work, between two verdicts
UNBOUND_PEAK = 0.45  # a peak share of the pool in use below this: a 16-bit cache (about half the blocks) held it all


class KVPremise:
    """Watches the share of the KV pool in use after each step; at the end of every WINDOW_STEPS steps, says in the
    log when the pool's peak stayed below UNBOUND_PEAK (memory did not bind), and again when it binds after that."""

    def __init__(self, kv_dtype: str):
        self.kv_dtype = kv_dtype
        self.steps, self.peak = 0, 0.0
        self.unmet = False  # the last window's verdict: memory did not bind
        self.num_unmet = 0  # times it said so

    def observe(self, usage: float) -> None:
        self.steps += 1
        self.peak = max(self.peak, usage)
        if self.steps < WINDOW_STEPS:
            return
        unmet = self.peak < UNBOUND_PEAK
        if unmet and not self.unmet:
            self.num_unmet += 1
            log.warning("the %s KV cache's premise does not hold on this load: over the last %d steps at most %.0f%% of "
                        "its pool was in use, so a 16-bit cache (--kv-cache-dtype auto) would hold the same sequences "
                        "without the quantization's quality cost", self.kv_dtype, WINDOW_STEPS, 100 * self.peak)
        elif self.unmet and not unmet:
            log.info("the %s KV cache now pays: %.0f%% of its pool was in use over the last %d steps", self.kv_dtype,
                     100 * self.peak, WINDOW_STEPS)
        self.unmet = unmet
        self.steps, self.peak = 0, 0.0
