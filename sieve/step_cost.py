"""What a step costs on this machine: seconds per engine step as a function of the tokens it computes and of the
keys its decode rows attend to. The engine owns one `StepCostModel` wherever a run-time choice needs it (adaptive
speculation, SLO pacing), seeds it at load where asked (`calibrate_step_cost`) and feeds it every step it runs.

It is measured, not assumed: exponential moving averages per token count up to 32 and per geometric bucket above,
interpolated, plus a cost per attended key, all times a scale that follows the machine's drift. Decode on a small
batch is bound by the weights' bytes, so extra rows are nearly free; on a large batch, or on a CPU where compute is
the limit, every row costs; the model sees which. Small counts are kept apart because the cost is a staircase
there: the AVX2 int4 kernels take rows four at a time, so on SmolLM2 the 9th row of a step costs ~6 ms and the 10th
to 12th ~1 ms each. A decode row also attends to its sequence's whole context: on this CPU 32 rows at 512 tokens of
context take 1.4x the time of 32 rows at position 0 (SmolLM2), and 3.5x at 128 tokens on a model small enough for
attention to lead (stories260K), so a calibration at position 0 alone makes long sequences' rows look cheaper
than they are.
"""

from __future__ import annotations

import bisect
import math
import statistics


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


def calibrate_step_cost(cost: StepCostModel, time_rows, config, multi_group: bool, free_tokens: int, borrowed_blocks,
                        reps: int = 5) -> None:
    """Seed the step-cost model: time decode steps of every row count up to the
    model's exact range (where kernels that take rows in groups make the cost a staircase), then of 64, 128,
    256 rows, on this machine, before any request. Every real step refines it afterwards.

    Untimed steps first (first calls allocate, compile and fill caches), then `reps` rounds over every count,
    the median of each: a machine that speeds up or slows down while it runs shifts every count alike, where
    timing one count's repeats after another's would give the first counts the slow start. `time_rows(n, tables,
    context=0)`: seconds of one step of n decode rows of one sequence from `context` (the model runner's
    `time_decode_rows`); `borrowed_blocks(n)`:
    block tables for n tokens, lent from the engine's free pool; `multi_group`: the model's layers keep windows or
    recurrent state (no single context to time the keys' cost at: it stays 0)."""
    cap = min(config.max_num_batched_tokens, 4 * config.max_num_seqs, 256)
    rows = cost.calibration_rows(cap)
    with borrowed_blocks(1) as tables:
        for n in (rows[0], rows[-1], rows[0]):
            time_rows(n, tables)
        times = {n: [] for n in rows}
        for _ in range(reps):
            for n in rows:
                times[n].append(time_rows(n, tables))
        for n in rows:
            cost.observe(n, statistics.median(times[n]), n)
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
            extra = [time_rows(n, tables, context) - time_rows(n, tables) for _ in range(reps)]
            cost.observe_keys(n, n * context + n * (n - 1) // 2, statistics.median(extra))


def decode_keys(sched) -> int:
    """Keys a step's decode rows attend to (each row its context up to itself, drafted rows and other chains
    included); prefill chunks are left out. Read before the step runs: it counts from the tokens computed so far."""
    keys = 0
    for s in sched.scheduled:
        c = s.seq.num_computed_tokens
        if s.num_real_tokens == 1 and c == s.seq.num_tokens - 1:
            for n in [s.num_new_tokens] + [b.num_rows for b in s.branches]:
                keys += n * c + n * (n + 1) // 2
    return keys
