"""The expected wait of a queued request: when it will start and when its first token will come, from a simulation
of the queue ahead of it (vLLM's users asked for per-request queue timings; llama.cpp reports progress).

The simulation runs the scheduler's arithmetic forward in time, jumping from event to event (a sequence finishing,
a prefill done): the running sequences decode one token a step until their expected lengths, the waiting ones ahead
take each free slot in order, and each prompt is computed in chunks of the step's token budget beside the decodes,
less what the prefix cache holds of it. A step of n tokens takes what the engine's step-cost model measured for n
(sieve/step_cost.py). A sequence's expected length is its max_tokens times the share of max_tokens finished
requests actually generated (learnt as they finish), never less than it has already.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class QueueEstimate:
    position: int  # requests ahead of it in the queue
    start_s: float | None  # seconds until it is scheduled (None until the step cost is known)
    first_token_s: float | None  # seconds until its first token


class QueueETA:
    OUTPUT_RATE = 0.1  # weight of each finished request in the output share's moving average
    MAX_EVENTS = 100_000  # a bound on the simulation's work (2,000 waiting behind 64 running: ~20 ms, on the engine thread)

    def __init__(self, cost, max_num_seqs: int, token_budget: int, block_size: int):
        self.cost, self.max_num_seqs, self.token_budget, self.block_size = cost, max_num_seqs, token_budget, block_size
        self.output_share = 1.0  # generated / max_tokens of finished requests (1: every request runs to max_tokens)

    def finished(self, generated: int, max_tokens: int | None) -> None:
        if max_tokens:
            self.output_share += self.OUTPUT_RATE * (min(1.0, generated / max_tokens) - self.output_share)

    def _expected(self, seq) -> int:
        """Tokens the sequence is expected to generate in all (at least one more than it has)."""
        generated = seq.num_tokens - seq.num_prompt_tokens
        return max(generated + 1, math.ceil(self.output_share * (seq.params.max_tokens or 1)))

    def estimate(self, seq, waiting: list, running: list, cached_tokens, token_budget: int | None = None) -> QueueEstimate:
        """`seq`'s estimate, `waiting` the queue in order of service (it among them), `running` those scheduled;
        `cached_tokens(s)`: the tokens of s the prefix cache holds now; `token_budget`: a step's tokens now (the SLO
        pacer's; default the configured budget)."""
        budget = token_budget or self.token_budget
        ahead = waiting[: waiting.index(seq)]
        if not self.cost.ready:
            return QueueEstimate(len(ahead), None, None)

        def generated(s) -> int:
            return s.num_tokens - s.num_prompt_tokens

        decoding = [self._expected(s) - generated(s) for s in running if s.num_computed_tokens >= s.num_tokens - 1]
        # [prompt tokens left, decode steps after them, whether it is `seq`]
        prefilling = [[s.num_tokens - s.num_computed_tokens, self._expected(s) - generated(s), False]
                      for s in running if s.num_computed_tokens < s.num_tokens - 1]
        queue = [[max(1, s.num_tokens - cached_tokens(s)), self._expected(s) - generated(s), s is seq] for s in ahead + [seq]]
        t, start = 0.0, None
        for _ in range(self.MAX_EVENTS):
            while queue and len(decoding) + len(prefilling) < self.max_num_seqs:  # a free slot: the next in line
                prefilling.append(queue.pop(0))
            rows = len(decoding)
            left = max(1, budget - rows)  # the prompts take what the decodes leave, in order
            shares = []
            for entry in prefilling:
                shares.append(min(entry[0], left))
                left -= shares[-1]
                if entry[2] and shares[-1] and start is None:  # its first chunk: it is scheduled now
                    start = t
            # until the next event: a prompt computed, or a sequence at its end
            steps = min([math.ceil(e[0] / n) for e, n in zip(prefilling, shares) if n] + decoding, default=math.inf)
            if steps == math.inf:
                break
            t += steps * self.cost.predict(rows + sum(shares))
            decoding = [d - steps for d in decoding if d > steps]
            for entry, n in zip(prefilling, shares):
                entry[0] -= steps * n
            for done in [e for e in prefilling if e[0] <= 0]:  # its first token came with its prompt's last step
                if done[2]:
                    return QueueEstimate(len(ahead), start, t)
                if done[1] > 1:
                    decoding.append(done[1] - 1)
            prefilling = [e for e in prefilling if e[0] > 0]
        return QueueEstimate(len(ahead), start, None)
