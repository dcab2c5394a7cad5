"""The mean and covariance of a prompt's queries before rotation, per attention layer and query head: what expected
attention scores keys against. Gathered while the prompt's prefill runs (the step hands each tapped row's queries
over, sieve/layers/attention.py `QueryTap`), in running sums, so no pass over the prompt is repeated; positions the
sequence did not compute itself (its prefix-cache hits) are run through a pass that writes nothing when the press
asks (`missing`).
"""

from __future__ import annotations

import torch


class QueryStats:
    """Running sums over positions `first` .. (the prompt's end) of one sequence's queries, per attention layer:
    shifted by the first rows seen (so that the covariance is not the difference of two large numbers in float32)."""

    def __init__(self, first: int):
        self.first = first  # positions before it are not counted (kvpress's sink tokens)
        self.covered: list[tuple[int, int]] = []  # disjoint ascending position ranges whose queries are summed
        self.shift: dict[int, torch.Tensor] = {}  # layer -> [H, D]
        self.sum: dict[int, torch.Tensor] = {}  # layer -> [H, D]: sum of (q - shift)
        self.outer: dict[int, torch.Tensor] = {}  # layer -> [H, D, D]: sum of (q - shift)(q - shift)^T

    def take(self, start: int, end: int) -> list[tuple[int, int]]:
        """The ranges of positions start .. end - 1 to count that are not counted yet, marked counted (the step that
        computes them hands their queries over)."""
        ranges = self._uncovered(max(start, self.first), end)
        for r in ranges:
            self._cover(*r)
        return ranges

    def missing(self, end: int) -> list[tuple[int, int]]:
        """The ranges of positions first .. end - 1 not counted: those the sequence took from the prefix cache."""
        return self._uncovered(self.first, end)

    def add(self, layer: int, q: torch.Tensor) -> None:
        """Count queries q [n, H, D] of one attention layer."""
        if not q.shape[0]:
            return
        q = q.float()
        if layer not in self.shift:
            self.shift[layer] = q.mean(dim=0)
            self.sum[layer] = torch.zeros_like(self.shift[layer])
            self.outer[layer] = q.new_zeros(q.shape[1], q.shape[2], q.shape[2])
        x = (q - self.shift[layer]).transpose(0, 1)  # [H, n, D]
        self.sum[layer] += x.sum(dim=1)
        self.outer[layer] += torch.matmul(x.transpose(1, 2), x)

    @property
    def count(self) -> int:
        return sum(b - a for a, b in self.covered)

    def moments(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean [H, D], covariance [H, D, D]) of layer `layer`'s counted queries (the covariance divided by their
        count, as kvpress's)."""
        n = self.count
        m = self.sum[layer] / n
        return self.shift[layer] + m, self.outer[layer] / n - m[:, :, None] * m[:, None, :]

    def clear(self) -> None:
        """Forget every sum (after the press: a sequence preempted later counts its recomputed prompt afresh)."""
        self.covered, self.shift, self.sum, self.outer = [], {}, {}, {}

    def _uncovered(self, start: int, end: int) -> list[tuple[int, int]]:
        out, at = [], start
        for a, b in self.covered:
            if b <= at:
                continue
            if a >= end:
                break
            if a > at:
                out.append((at, a))
            at = max(at, b)
        if at < end:
            out.append((at, end))
        return out

    def _cover(self, start: int, end: int) -> None:
        merged = []
        for a, b in sorted(self.covered + [(start, end)]):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.covered = merged
