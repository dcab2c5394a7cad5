"""Scarcity scheduling between tenants (the engine's side of `--tenants`): each tier's guaranteed share of the running
slots, and fair service between the tenants of one tier.

- **Guaranteed slots.** A tier with share s is guaranteed floor(s x max_num_seqs) running slots while it has requests
  waiting. A slot it leaves idle is lent to the others; a waiting request of a tier below its guarantee takes one back
  at the next step (the borrower with the largest (priority, arrival) among the tiers over their guarantee is
  preempted, by recompute, keeping its tokens and its place: it re-enters the queue with its arrival order).
- **Guaranteed tokens.** A waiting request goes before the prompt chunks of running requests of a lower priority
  (the scheduler defers them until it has had its turn), but each deferred chunk's tier keeps floor(s x the step's
  token budget) of the step for them, so a higher tier's prompts never stop a lower tier's prompts in progress.
- **Fair shares within a tier.** Among waiting requests of the same priority the tenant that has been served least
  goes first, counted in weighted tokens (the Virtual Token Counter of Sheng et al., 2024: a prompt token weighs 1,
  a generated one 2). A tenant that comes back after being idle starts at the least counter of those active, so it
  cannot bank credit while away.

Requests without a tier (no --tenants, or the offline API) are one tier, "default", with no guarantee.

**Background work.** A request of priority `BACKGROUND` or past it (the Batch API's) runs only in the capacity the
others leave: in a step that computes anything for them, its rows may slow that step by at most
`EngineConfig.background_slowdown` (a tenth, by default), as the step-cost model predicts, and it has no row in a
step that runs an interactive prompt's chunk (a time to first token); the rest of its rows wait for a later step. A
step with nothing else in it is its own, sized to half the objective's step (sieve/pacing.py BACKGROUND_STEP_SHARE):
an interactive request that arrives waits for it to end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT = "default"
BACKGROUND = 1 << 40  # a priority from which a request is background work: below every tier's (tier x stride + own)
PROMPT_WEIGHT, OUTPUT_WEIGHT = 1, 2


@dataclass
class TierPolicy:
    shares: dict[str, float]  # tier -> guaranteed fraction of max_num_seqs (checked by EngineConfig.validate)
    max_num_seqs: int
    served: dict[str, float] = field(default_factory=dict)  # tenant -> weighted tokens served

    def guaranteed(self, tier: str) -> int:
        return math.floor(self.shares.get(tier, 0.0) * self.max_num_seqs + 1e-9)

    @staticmethod
    def tier_of(seq) -> str:
        return seq.request.tier or DEFAULT

    @staticmethod
    def tenant_of(seq) -> str:
        return seq.request.tenant or ""

    def _counts(self, seqs) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in seqs:
            counts[self.tier_of(s)] = counts.get(self.tier_of(s), 0) + 1
        return counts

    def _short(self, waiting, running) -> dict[str, int]:
        """Tiers below their guarantee with requests waiting: the slots each is owed now."""
        run, wait = self._counts(running), self._counts(waiting)
        return {t: min(n, self.guaranteed(t) - run.get(t, 0)) for t, n in wait.items() if run.get(t, 0) < self.guaranteed(t)}

    def arrive(self, seq, active) -> None:
        """A new request: its tenant, idle until now, starts at the least counter of the tenants active."""
        tenant = self.tenant_of(seq)
        others = {self.tenant_of(s) for s in active} - {tenant}
        if tenant in {self.tenant_of(s) for s in active}:
            return
        floor = min((self.served.get(t, 0.0) for t in others), default=0.0)
        self.served[tenant] = max(self.served.get(tenant, 0.0), floor)

    def count(self, seq, prompt_tokens: int, output_tokens: int) -> None:
        tenant = self.tenant_of(seq)
        self.served[tenant] = self.served.get(tenant, 0.0) + PROMPT_WEIGHT * prompt_tokens + OUTPUT_WEIGHT * output_tokens

    def pick(self, waiting: list, running: list) -> int:
        """Index in `waiting` of the request to admit next: from a tier owed slots first (the highest priority of
        them), else the best priority; among those, the tenant served least, then arrival."""
        short = self._short(waiting, running)
        pool = [i for i, s in enumerate(waiting) if self.tier_of(s) in short] or range(len(waiting))
        best = min(waiting[i].request.priority for i in pool)
        return min((i for i in pool if waiting[i].request.priority == best),
                   key=lambda i: (self.served.get(self.tenant_of(waiting[i]), 0.0), waiting[i].arrival_order))

    def held_tokens(self, deferred: list, step_budget: int) -> int:
        """Tokens of a step held for the deferred prompts (`deferred`, running sequences a waiting request of a
        higher priority goes before): each of their tiers' guaranteed share of the step's budget, at most what its
        prompts there have left."""
        left: dict[str, int] = {}
        for s in deferred:
            left[self.tier_of(s)] = left.get(self.tier_of(s), 0) + s.num_tokens - s.num_computed_tokens
        return sum(min(n, math.floor(self.shares.get(t, 0.0) * step_budget)) for t, n in left.items())

    def may_lose(self, seq, running: list) -> bool:
        """Whether `seq`'s tier keeps its guarantee without it (a higher priority may then displace it)."""
        return self._counts(running).get(self.tier_of(seq), 0) > self.guaranteed(self.tier_of(seq))

    def take_back(self, waiting: list, running: list):
        """With every slot taken and a tier owed one: the borrower to preempt (the largest (priority, arrival) of the
        tiers over their guarantee), or None."""
        if len(running) < self.max_num_seqs or not self._short(waiting, running):
            return None
        run = self._counts(running)
        over = [s for s in running if run[self.tier_of(s)] > self.guaranteed(self.tier_of(s))]
        return max(over, key=lambda s: s.schedule_key, default=None)
