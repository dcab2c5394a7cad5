"""SLO pacing: how many tokens the next step computes, and whether a waiting request may join, chosen so that the
sequences already decoding keep their time per output token (stall-free batching, as in Sarathi-Serve).

A step's time is every running decode's time per token that step. With one fixed token budget a long prompt's
chunk makes the step that carries it as slow as the prompt is long (SmolLM2 on 2 Zen 4 cores: 2048 tokens take
~0.5 s, five times a 100 ms TPOT objective). The pacer instead gives the step the most tokens the measured
step-cost model (sieve/step_cost.py) predicts to fit in `STEP_SHARE` of the TPOT objective, given the decode rows
and the keys they attend to; prefill chunks take what is left, and never less than `min_chunk` so that prompts
always progress. Where nothing decodes, no TPOT is at stake and the step takes the configured budget.

Admission: a waiting request joins only if the decode step with it (every running sequence and it decoding, plus
a minimal chunk) is still predicted within the share; otherwise it waits in the queue, and those already running
keep their TPOT. Until the cost model has seen two step sizes it predicts nothing, and the configured budget and
max_num_seqs hold alone. Nor does it join while the free blocks cannot hold the rest of its prompt (`leaves_room`).
"""

from __future__ import annotations

from sieve.sequence import Sequence
from sieve.step_cost import StepCostModel
from sieve.tenancy import BACKGROUND

# A step may take this share of the TPOT objective; the rest is margin for noise and the machine's drift between
# measurements. A user's TPOT is the mean of the steps it decodes in, so the margin need not cover one slow step:
# under a share of 0.8 the ladder's users saw TPOT p99 at 0.94 of the target (SmolLM2, int8, 38 to 40 users), and
# the fifth left unused was what new users' prompts needed (their TTFT p99 bound there, at 4 s).
STEP_SHARE = 0.9
# A step of background work alone (the Batch API's, with nothing interactive running) is sized to this share of the
# objective's step: an interactive request that arrives waits for it to end.
BACKGROUND_STEP_SHARE = 0.5


class SloPacer:
    def __init__(self, cost: StepCostModel, tpot_slo_s: float, max_budget: int, min_chunk: int):
        self.cost, self.target = cost, STEP_SHARE * tpot_slo_s
        self.max_budget, self.min_chunk = max_budget, max(1, min(min_chunk, max_budget))

    def token_budget(self, running: list[Sequence]) -> int:
        """Tokens the next step may compute: the most predicted to fit in the share, given the running decodes
        (each with its drafts), and at least those decodes and one minimal chunk. Background rows do not count
        where others run: they take only what they are allowed beyond (`background_allowance`)."""
        rows = keys = 0
        alone = all(s.request.priority >= BACKGROUND for s in running)  # background work alone: a shorter step
        for s in foreground(running):
            if s.num_tokens - s.num_computed_tokens == 1:
                n = 1 + len(s.draft_state.token_ids)
                rows += n
                keys += n * s.num_tokens + n * (n - 1) // 2
        if not rows or not self.cost.ready:
            return self.max_budget
        floor = min(rows + self.min_chunk, self.max_budget)
        return max(floor, self._fit(rows, keys, BACKGROUND_STEP_SHARE * self.target if alone else self.target))

    def admits(self, running: list[Sequence], seq: Sequence) -> bool:
        """May `seq` join the running batch: is the decode step with it still predicted within the share?"""
        others = running if seq.request.priority >= BACKGROUND else foreground(running)
        if not others or not self.cost.ready:
            return True
        rows = len(others) + 1
        keys = sum(s.num_tokens for s in others) + seq.num_tokens
        return self.cost.predict(rows + self.min_chunk, keys) <= self.target

    def background_allowance(self, tokens: int, keys: int, slowdown: float) -> int:
        """Tokens background work may add to a step whose other rows are `tokens` (their decodes attending to `keys`
        keys): the most predicted to make it at most `slowdown` slower (its own keys left out)."""
        if not self.cost.ready:
            return self.max_budget
        limit = (1 + slowdown) * self.cost.predict(tokens, keys)
        return self._largest(0, lambda n: self.cost.predict(tokens + n, keys) <= limit)

    @staticmethod
    def leaves_room(seq: Sequence, free_tokens: int, num_running: int, block_size: int) -> bool:
        """Memory admission: may `seq` join, its cached prefix taken? Only if the free blocks hold the rest of its
        prompt and still a block for each running sequence and for it. A prompt admitted on its first chunk's blocks
        alone would take the later chunks' blocks from those running: preemption by recompute, which costs a
        decoding user its whole context again (a 4k-token document: seconds on a CPU)."""
        return seq.num_tokens - seq.num_computed_tokens + block_size * (num_running + 1) <= free_tokens

    def _fit(self, rows: int, keys: int, target: float) -> int:
        """The largest token count in [rows, max_budget] whose step is predicted within `target` (`rows` if none)."""
        if self.cost.predict(rows, keys) > target:
            return rows
        return self._largest(rows, lambda n: self.cost.predict(n, keys) <= target)

    def _largest(self, lo: int, fits) -> int:
        """The largest n in [lo, max_budget] that `fits` (`lo` fitting): a bisection, the prediction being
        non-decreasing in the tokens."""
        hi = self.max_budget
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

def foreground(running: list[Sequence]) -> list[Sequence]:
    """The running sequences that are not background work, or all of them where all are."""
    return [s for s in running if s.request.priority < BACKGROUND] or running
