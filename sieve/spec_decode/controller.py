"""How many tokens each sequence drafts next step.

Fixed depth: `num_speculative_tokens` for every sequence. "auto": the depth that maximises expected tokens
per second of the next step, from two measured things:

- `StepCostModel`: seconds per engine step as a function of the tokens it computes and of the keys its decode
  rows attend to, measured on this machine (a calibration at load, then every step, as exponential moving
  averages per token count up to 32 and per geometric bucket above, interpolated, plus a cost per attended key,
  all times a scale that follows the machine's drift). Decode on a small batch is bound by the weights' bytes,
  so extra rows are nearly free; on a large batch, or on a CPU where compute is the limit, every row costs —
  the model sees which. Small counts are kept apart because the cost is a staircase there: the AVX2 int4
  kernels take rows four at a time, so on SmolLM2 the 9th row of a step costs ~6 ms and the 10th to 12th ~1 ms
  each. A drafted row also attends to its sequence's whole context: on this CPU 32 rows at 512 tokens of
  context take 1.4x the time of 32 rows at position 0 (SmolLM2), and 3.5x at 128 tokens on a model small
  enough for attention to lead (stories260K), so a calibration at position 0 alone makes long sequences'
  drafts look cheaper than they are.
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
a choice.

Draft trees ("auto" with `num_branches` W > 1, `choose_tree`): after the depths, a sequence drafting k may verify
further chains, each 1 + k more rows. Chain c adds tokens only where chains 0 .. c - 1 are wrong; from verified
trees the controller learns, per rank c, the tokens chain c accepted beyond the best before it, per unit of
(1 - a_s,1) x (1 + a_s,2 + a_s,2 a_s,3 + ...): the first chain's miss rate times what a right first draft goes on
to give. Chains are added in order of gain per row while the expected tokens per second rise, within the token
budget, each also priced at the proposer's measured seconds per token of a further chain.
"""

from __future__ import annotations

import bisect
import itertools
import math

from sieve.sequence import Sequence
from sieve.spec_decode.config import SpeculativeConfig

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


class StepCostModel:
    """Seconds per step = `scale` x the shape stored per bucket. A decode-sized step (up to `EXACT` tokens)
    observed in a bucket it has already seen moves both towards itself, mostly the scale: a shared machine's
    speed drifts by tens of percent from minute to minute, and the buckets seen only at calibration must drift
    with the ones every step refreshes. Were only the refreshed ones to follow, the curve would lose its shape
    (after a slowdown the 8-row bucket rises past the 9-to-16-row ones, and drafted rows look free). Larger
    steps (prefill) move only their own bucket: they differ from the calibration's rows by more than drift."""

    EXACT = 32  # token counts up to this have a bucket each: kernels that take rows in groups make a staircase there
    BASE = 1.25  # above it, bucket width: token counts within 25% share a bucket
    DECAY = 0.8  # of a bucket's mean token count
    SCALE_RATE, SHAPE_RATE = 0.18, 0.02  # shares of an observation's log error taken by the scale and by its bucket
    MAX_WEIGHT = 20  # a bucket's weight in the monotone fit: the observations it holds, up to this many

    def __init__(self) -> None:
        # bucket -> [mean tokens, seconds / scale without the keys' part, weight]
        self.buckets: dict[int, list[float]] = {}
        self.scale = 1.0
        self.per_key = 0.0  # seconds / scale per key a decode row attends to (its context), from `observe_keys`
        self._keys_seen = 0
        self._curve: tuple[list[float], list[float]] | None = None  # (xs, non-decreasing ys), until the next observation

    def observe(self, num_tokens: int, seconds: float, keys: int = 0) -> None:
        """A step of `num_tokens` tokens took `seconds`; its decode rows attended to `keys` keys in all."""
        if num_tokens < 1 or not seconds > 0:
            return
        self._curve = None
        b = num_tokens if num_tokens <= self.EXACT else self.EXACT + 1 + round(math.log(num_tokens / self.EXACT, self.BASE))
        point = self.buckets.get(b)
        attention = self.per_key * keys
        if point is None:
            self.buckets[b] = [float(num_tokens), max(seconds / self.scale - attention, 0.1 * seconds / self.scale), 1.0]
        else:
            point[2] = min(point[2] + 1, self.MAX_WEIGHT)
            error = seconds / (self.scale * (point[1] + attention))
            if num_tokens <= self.EXACT:  # decode-sized: the steps speculation chooses between
                self.scale *= error**self.SCALE_RATE
                point[1] *= error**self.SHAPE_RATE
            else:  # prefill-sized: its own shape (causal attention over the prompt), learnt by its bucket alone
                point[1] *= error ** (self.SCALE_RATE + self.SHAPE_RATE)
            point[0] = self.DECAY * point[0] + (1 - self.DECAY) * num_tokens

    def calibration_rows(self, cap: int) -> list[int]:
        """Every count of the exact range, then doublings, up to `cap`."""
        rows = list(range(1, min(cap, self.EXACT) + 1))
        while rows and rows[-1] * 2 <= cap:
            rows.append(rows[-1] * 2)
        return rows

    def observe_keys(self, num_tokens: int, keys: int, extra_seconds: float) -> None:
        """Calibration: `num_tokens` rows attending to `keys` more keys in all took `extra_seconds` longer (a step
        over a long context against the same rows at position 0, timed side by side). Several calls (other row
        counts) average."""
        if keys < 1:
            return
        x = max(0.0, extra_seconds / self.scale / keys)
        self._keys_seen += 1
        self.per_key += (x - self.per_key) / self._keys_seen

    @property
    def seconds_per_key(self) -> float:
        """What one more attended key adds to a step, at the machine's present speed."""
        return self.scale * self.per_key

    @property
    def ready(self) -> bool:
        return len(self.buckets) >= 2

    def predict(self, num_tokens: float, keys: float = 0.0) -> float:
        """Seconds for a step of `num_tokens` tokens whose decode rows attend to `keys` keys: piecewise linear
        through the bucket means made non-decreasing, extended beyond them along the nearest segment (never
        decreasing), plus the keys' part.

        Non-decreasing by a weighted monotone (isotonic) fit: adjacent buckets out of order are pooled into their
        weighted mean, each weighing the observations it holds. A running maximum instead lets one slow sample
        (a calibration step caught by a pause) lift every larger count to it, however often real steps there
        measured less: on an H200 every step of 33 to 96 rows came in at 0.78 of its prediction that way."""
        if self._curve is None:
            pts = sorted(self.buckets.values())
            pools: list[list[float]] = []  # [weighted sum, weight, buckets pooled]
            for _, y, w in pts:
                pools.append([w * y, w, 1])
                while len(pools) > 1 and pools[-2][0] * pools[-1][1] > pools[-1][0] * pools[-2][1]:
                    top = pools.pop()
                    pools[-1] = [pools[-1][0] + top[0], pools[-1][1] + top[1], pools[-1][2] + top[2]]
            ys = [total / weight for total, weight, count in pools for _ in range(count)]
            self._curve = [p[0] for p in pts], ys
        return self.scale * self._shape(num_tokens) + self.seconds_per_key * keys

    def _shape(self, num_tokens: float) -> float:
        xs, ys = self._curve
        if len(xs) == 1:
            return ys[0] * max(1.0, num_tokens / xs[0])
        if num_tokens <= xs[0]:
            return ys[0]
        i = bisect.bisect_left(xs, num_tokens)
        if i < len(xs):
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 + (y1 - y0) * (num_tokens - x0) / max(x1 - x0, 1e-9)
        x0, x1, y0, y1 = xs[-2], xs[-1], ys[-2], ys[-1]
        return y1 + max(0.0, (y1 - y0) / max(x1 - x0, 1e-9)) * (num_tokens - x1)


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
        best_m = self._best_prefix(gains, n, base, keys, draft_cost)
        ks = [0] * n
        for _, i, _ in gains[:best_m]:
            ks[i] += 1
        return ks

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
        for g, r, k_rows, d, i in items:
            if budget is not None and rows + r > budget:
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
