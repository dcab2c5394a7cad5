"""How many tokens each sequence drafts next step.

Fixed depth: `num_speculative_tokens` for every sequence. "auto": the depth that maximises expected tokens
per second of the next step, from two measured things:

- `StepCostModel` (sieve/step_cost.py): seconds per engine step as a function of the tokens it computes and of
  the keys its decode rows attend to, measured on this machine; the engine owns it and feeds it every step.
- Acceptance: per sequence and draft position j, the chance that draft token j is accepted given that the ones
  before it were (recency-weighted counts per sequence, smoothed towards the running global rate of the
  method). For proposers that cost nothing to ask (n-gram, suffix), the speculator measures this on every
  step from a full-depth probe, whatever depth was verified, so a sequence given k = 0 still shows when its
  drafts start to be right. Proposers that cost something to ask (EAGLE, Medusa, a draft model) are probed
  unverified now and then, at a rate that keeps probing under `PROBE_SHARE` of the time (sieve/spec_decode/speculator.py).
- `DraftCostModel`: seconds per drafted token of the proposer itself, measured on every call (zero for the free
  ones: they are asked every step anyway).

With a_s,j those rates, drafting k tokens for sequence s yields 1 + sum_{j<=k} prod_{i<=j} a_s,i tokens in
expectation. Each sequence's marginal gains decrease with depth, so the best set of M extra rows is the M
largest marginal gains over all sequences; the controller takes the M (0 included) that maximises
(expected tokens) / (t(base rows + M) + M * drafting cost per token), and wants a `MARGIN` better rate than not
speculating at all, so a noisy estimate never makes a step slower. Depth is therefore per sequence, and k = 0 is
a choice. Under a TPOT objective with prompt tokens waiting, prefill comes first: drafted rows take only the time
those tokens leave within the pacer's share of a step (`_rows_left_by_prefill`).

Draft trees ("auto" with `num_branches` W > 1, `choose_tree`): after the depths, a sequence drafting k may verify
further chains, each 1 + k more rows. Chain c adds tokens only where chains 0 .. c - 1 are wrong; from verified
trees the controller learns, per rank c, the tokens chain c accepted beyond the best before it, per unit of
(1 - a_s,1) x (1 + a_s,2 + a_s,2 a_s,3 + ...): the first chain's miss rate times what a right first draft goes on
to give. Chains are added in order of gain per row while the expected tokens per second rise, within the token
budget, each also priced at the proposer's measured seconds per token of a further chain.
"""

from __future__ import annotations

import itertools
import math

from sieve.pacing import STEP_SHARE
from sieve.sequence import Sequence
from sieve.spec_decode.config import SpeculativeConfig
from sieve.step_cost import StepCostModel

MARGIN = 0.03  # speculation must promise at least this much more throughput than none
# Under a TPOT SLO, drafting may lengthen the slowest sequence's expected time per token up to this share of the SLO;
# past it, only choices that leave no sequence slower than without drafts. The TPOT a user's p99 sees sits well above
# a step's expected time (prefill chunks join steps), so the headroom is kept for them.
SLO_HEADROOM = 0.5
PRIOR_WEIGHT = 2.0  # pseudo-counts of the global rate in a sequence's estimate
GLOBAL_DECAY = 0.995  # per recorded draft: the global rate follows the workload
SEQ_DECAY = 0.7  # per recorded draft: a sequence's estimate follows its recent drafts (copying starts and stops)
PROBE_REACH = 0.25  # a probe drafts the positions expected to be reached at least this often, and one more
CHAIN_PRIOR = 0.1  # a draft tree's chain c adds CHAIN_PRIOR / c (x its sequence's miss rate and extent) until measured


class DraftCostModel:
    """Seconds a proposer takes per drafted token (exponential moving average over its calls)."""

    DECAY = 0.8

    def __init__(self) -> None:
        self.per_token: float | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < 1 or not seconds >= 0:
            return
        x = seconds / num_tokens
        self.per_token = x if self.per_token is None else self.DECAY * self.per_token + (1 - self.DECAY) * x


class DepthController:
    def __init__(self, config: SpeculativeConfig, cost: StepCostModel, tpot_slo_s: float | None = None):
        self.auto, self.K, self.cost = config.auto, config.max_k, cost
        # The server's time-per-output-token SLO: every running sequence's expected TPOT (the step's time over the
        # tokens it expects to emit) is kept within it first; throughput is maximised only within it.
        self.tpot_slo_s = tpot_slo_s
        self.global_tried = [0.0] * self.K
        self.global_accepted = [0.0] * self.K
        self.per_seq: dict[Sequence, tuple[list[int], list[int]]] = {}  # seq -> (tried, accepted) per position
        # Draft trees under "auto" (`num_branches` the widest): what chain c >= 1 adds, as tokens accepted beyond the
        # best of chains 0 .. c - 1 (decayed sums), per unit of (the first chain's miss rate) x (the tokens a chain
        # whose first draft is right goes on to give): see `chain_gains`.
        self.W = config.num_branches if config.auto else 1
        self.chain_gain = [0.0] * self.W
        self.chain_norm = [0.0] * self.W

    def rates(self, seq: Sequence, depth: int | None = None) -> list[float]:
        """Estimated acceptance of each draft position (the first `depth`) given the previous ones were accepted."""
        tried, accepted = self.per_seq.get(seq, (None, None))
        out = []
        for j in range(self.K if depth is None else min(depth, self.K)):
            g = (self.global_accepted[j] + 1.0) / (self.global_tried[j] + 2.0)
            if tried is None:
                out.append(g)
            else:
                out.append((accepted[j] + PRIOR_WEIGHT * g) / (tried[j] + PRIOR_WEIGHT))
        return out

    def choose(self, seqs: list[Sequence], caps: list[int], extra_tokens: int = 0, budget: int | None = None,
               draft_cost: float = 0.0, contexts: list[int] | None = None) -> list[int]:
        """Draft depth per sequence (each at most its cap); `extra_tokens`: other tokens expected next step;
        `draft_cost`: seconds the proposer takes per token it drafts; `contexts`: each sequence's length (the
        keys its decode row attends to; its j-th drafted row attends to j more)."""
        if not self.auto:
            return [min(self.K, c) for c in caps]
        n = len(seqs)
        if not n or not self.cost.ready:
            return [0] * n
        contexts = contexts or [0] * n
        gains = []  # (expected tokens the row adds, sequence, keys the row attends to)
        for i, (seq, cap) in enumerate(zip(seqs, caps)):
            g = 1.0
            for j, a in enumerate(self.rates(seq, cap), 1):
                g *= a
                gains.append((g, i, contexts[i] + j))
        base, keys = n + extra_tokens, sum(contexts)
        # Rows in order of tokens per second they add: a row's cost is the step's average row (at position 0) plus
        # its keys. Within a sequence that order is its depth order (gains fall, keys grow).
        row = max((self.cost.predict(base + len(gains)) - self.cost.predict(base)) / max(len(gains), 1), 1e-9)
        key = self.cost.seconds_per_key
        gains.sort(key=lambda x: -x[0] / (row + key * x[2]))
        if budget is not None:
            del gains[max(0, budget - n - extra_tokens):]
        del gains[self._rows_left_by_prefill(gains, base, keys, extra_tokens):]
        best_m = self._best_prefix(gains, n, base, keys, draft_cost)
        ks = [0] * n
        for _, i, _ in gains[:best_m]:
            ks[i] += 1
        return ks

    def _rows_left_by_prefill(self, gains: list, base: int, keys: int, extra_tokens: int) -> int:
        """Prefill first: with a TPOT objective and prompt tokens waiting (`extra_tokens`), how many of the ordered
        candidate rows fit in the pacer's share of the objective after those tokens. The pacer fills each step to that
        share (sieve/pacing.py) and gives prompts what decode rows and their drafts leave: a drafted row past it takes
        a newcomer's prefill time, so its time to first token pays for throughput that, at a load where prompts wait,
        drafting does not add. (An FP8 cache, whose keys cost less, drafted twice the rows of a 16-bit one at the same
        throughput, and its TTFT p99 doubled.) Without waiting prompts, or an objective, every row stays a candidate."""
        if not extra_tokens or self.tpot_slo_s is None:
            return len(gains)
        target = STEP_SHARE * self.tpot_slo_s
        upto = list(itertools.accumulate((k for _, _, k in gains), initial=keys))  # keys with the first m rows
        lo, hi = 0, len(gains)  # the most rows whose step fits: a bisection, the prediction growing with m
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost.predict(base + mid, upto[mid]) <= target:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _best_prefix(self, gains: list, n: int, base: int, keys: int, draft_cost: float) -> int:
        """How many of the ordered candidate rows to draft: the most expected tokens per second, at least MARGIN above
        none; with a TPOT SLO, among the choices whose slowest sequence stays within `slo_limit` (or, where none does,
        the one whose slowest sequence is fastest)."""
        t0 = self.cost.predict(base, keys)
        best_rate, best_m, expected, most = n / t0 * (1 + MARGIN), 0, float(n), n + sum(g for g, _, _ in gains)
        slo = self.slo_limit(t0)
        per_seq, drafted = [1.0] * n, [False] * n  # each sequence's expected tokens this step; whether it drafts
        undrafted, best_ok, best_worst = n, slo is None or t0 <= slo, t0
        for m, (g, i, row_keys) in enumerate(gains, 1):
            expected += g
            keys += row_keys
            t = self.cost.predict(base + m, keys) + draft_cost * m
            if slo is None:
                if most / t <= best_rate:  # t only grows with m: no later m can do better
                    break
                if expected / t > best_rate:
                    best_rate, best_m = expected / t, m
                continue
            if best_ok and most / t <= best_rate:  # t only grows with m: no later m can beat the feasible best
                break
            undrafted -= not drafted[i]
            drafted[i] = True
            per_seq[i] += g
            worst = t / (1.0 if undrafted else min(per_seq))  # the slowest sequence's expected time per token
            if worst <= slo and (not best_ok or expected / t > best_rate):  # within the SLO first, then the fastest
                best_ok, best_rate, best_m = True, expected / t, m
            elif not best_ok and worst < best_worst:
                best_worst, best_m = worst, m
        return best_m

    def slo_limit(self, plain_step: float) -> float | None:
        """The longest expected time per token the slowest sequence may get from drafting, given the step's time
        without drafts: the SLO's headroom share while the step is well within it, else the step itself (no sequence
        slower than without drafts), and never past the SLO. None: no SLO."""
        slo = self.tpot_slo_s
        return None if slo is None else min(slo, max(plain_step, SLO_HEADROOM * slo))

    def choose_tree(self, seqs: list[Sequence], caps: list[int], branchable: list[bool], extra_tokens: int = 0,
                    budget: int | None = None, draft_cost: float = 0.0, contexts: list[int] | None = None,
                    chain_cost: float = 0.0) -> tuple[list[int], list[int]]:
        """Depth and width per sequence: the depths `choose` gives, then further chains of `branchable` sequences
        (each 1 + k rows: the sequence's last token again, then k drafts) while they raise the expected tokens per
        second. A chain's expected gain is `chain_gains`; `chain_cost`: the proposer's seconds per token of a
        further chain (what drafting a tree costs beyond its first chain)."""
        n = len(seqs)
        ks = self.choose(seqs, caps, extra_tokens, budget, draft_cost, contexts)
        widths = [1] * n
        if self.W == 1 or not any(ks):
            return ks, widths
        contexts = contexts or [0] * n
        rates = [self.rates(s, k) if k else [] for s, k in zip(seqs, ks)]
        expected = float(n) + sum(math.fsum(itertools.accumulate(r, lambda a, b: a * b)) for r in rates)
        rows = n + extra_tokens + sum(ks)
        keys = sum((1 + k) * c + k * (k + 1) // 2 for c, k in zip(contexts, ks))  # as `choose` counts them
        drafted = draft_cost * sum(ks)
        items, gains = [], self.chain_gains()  # (expected tokens the chain adds, its rows, keys, tokens drafted, sequence)
        for i, (k, r) in enumerate(zip(ks, rates)):
            if k and branchable[i]:
                unit = (1 - r[0]) * _extent(r)
                chain_keys = (1 + k) * contexts[i] + k * (k + 1) // 2
                items += [(g * unit, 1 + k, chain_keys, k, i) for g in gains]
        # Best gain per row first; a sequence's chains keep their rank order (gains fall with the rank).
        items.sort(key=lambda x: -x[0] / x[1])
        # (No margin over the chain alone: `choose` has already required speculation to beat none by MARGIN.)
        best_rate = expected / (self.cost.predict(rows, keys) + drafted)
        most = expected + sum(x[0] for x in items)
        slo = self.slo_limit(self.cost.predict(n + extra_tokens, sum(contexts)))
        per_seq = [1.0 + math.fsum(itertools.accumulate(r, lambda a, b: a * b)) for r in rates]
        taken, best = [], 0
        target = STEP_SHARE * self.tpot_slo_s if extra_tokens and self.tpot_slo_s is not None else None
        for g, r, k_rows, d, i in items:
            if budget is not None and rows + r > budget:
                continue
            if target is not None and self.cost.predict(rows + r, keys + k_rows) > target:  # prefill first, as in `choose`
                continue
            expected, rows, keys, drafted = expected + g, rows + r, keys + k_rows, drafted + chain_cost * d
            taken.append(i)
            per_seq[i] += g
            t = self.cost.predict(rows, keys) + drafted
            if slo is None and most / t <= best_rate:  # t only grows: no later chain can do better
                break
            if expected / t > best_rate and (slo is None or t / min(per_seq) <= slo):
                best_rate, best = expected / t, len(taken)
        for i in taken[:best]:
            widths[i] += 1
        return ks, widths

    def chain_gains(self) -> list[float]:
        """Expected tokens chain c = 1 .. W - 1 of a tree adds per unit of (its sequence's first-chain miss rate) x
        (`_extent`, the tokens a chain with a right first draft gives): measured, smoothed towards a prior that falls
        with the rank, made non-increasing (the proposer ranks its guesses, and a width takes chains in that order)."""
        out, low = [], math.inf
        for c in range(1, self.W):
            g = (self.chain_gain[c] + PRIOR_WEIGHT * CHAIN_PRIOR / c) / (self.chain_norm[c] + PRIOR_WEIGHT)
            low = min(low, g)
            out.append(low)
        return out

    def record_chains(self, seq: Sequence, k: int, accepted: list[int]) -> None:
        """A verified tree of len(accepted) chains of k drafts for `seq` (before `record`, which updates the rates
        these are weighed by): chain c's draft had its first accepted[c] tokens right."""
        if self.W == 1:  # a fixed depth's trees: nothing chooses widths
            return
        rates = self.rates(seq, k)
        norm = (1 - rates[0]) * _extent(rates)
        best = accepted[0]
        for c in range(1, min(len(accepted), self.W)):
            self.chain_gain[c] = GLOBAL_DECAY * self.chain_gain[c] + max(0, accepted[c] - best)
            self.chain_norm[c] = GLOBAL_DECAY * self.chain_norm[c] + norm
            best = max(best, accepted[c])

    def probe_depth(self, seq: Sequence, cap: int) -> int:
        """How deep to probe `seq` (unverified): the positions its drafts are expected to reach at least
        `PROBE_REACH` of the time, and one more, so evidence grows one position past what is believed."""
        reach, depth = 1.0, 1
        for a in self.rates(seq, cap - 1):
            reach *= a
            if reach < PROBE_REACH:
                break
            depth += 1
        return depth

    def record(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        """A draft of `num_draft` tokens for `seq` had its first `num_accepted` right (and the next one wrong,
        if num_accepted < num_draft)."""
        tried, accepted = self.per_seq.setdefault(seq, ([0.0] * self.K, [0.0] * self.K))
        for j in range(self.K):
            self.global_tried[j] *= GLOBAL_DECAY
            self.global_accepted[j] *= GLOBAL_DECAY
            tried[j] *= SEQ_DECAY
            accepted[j] *= SEQ_DECAY
        for j in range(min(num_draft, num_accepted + 1)):  # positions reached: all accepted, then the first rejected
            hit = j < num_accepted
            tried[j] += 1
            accepted[j] += hit
            self.global_tried[j] += 1
            self.global_accepted[j] += hit

    def forget(self, seq: Sequence) -> None:
        self.per_seq.pop(seq, None)


def _extent(rates: list[float]) -> float:
    """Tokens a chain whose first draft is right gives in expectation: 1 + a_2 + a_2 a_3 + ... (rates[j]: position j's
    acceptance given the ones before it)."""
    return 1.0 + math.fsum(itertools.accumulate(rates[1:], lambda a, b: a * b))
