"""The one interface every speculative proposer implements.

A proposer sees the sequences that will decode next step and how many tokens each may draft (`ks`, chosen by
the depth controller), and returns a `Draft` per sequence: at most k token ids, and optionally the
distribution each was drawn from. Without a distribution the draft counts as deterministic (q one-hot), which
is what the n-gram and suffix proposers, and any proposer drafting its argmax, are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from sieve.sequence import Sequence


@dataclass
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] float32: q of each drafted position; None: one-hot


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Up to ks[i] draft tokens to follow seqs[i]'s last token (each k >= 1)."""
        ...

    def finish(self, seq: Sequence) -> None:
        """`seq` left the engine (finished or aborted): drop its state, learn from its output."""
        ...
