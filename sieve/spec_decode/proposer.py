"""The one interface every speculative proposer implements.

A proposer sees the sequences that will decode next step and how many tokens each may draft (`ks`, chosen by
the depth controller), and returns a `Draft` per sequence: at most k token ids, and optionally the
distribution each was drawn from. Without a distribution the draft counts as deterministic (q one-hot), which
is what the n-gram and suffix proposers, and any proposer drafting its argmax, are.

A proposer that ranks its guesses (EAGLE, Medusa) may also be asked for `branches[i]` chains per sequence: a draft
tree, flattened into its paths. `alternatives` are the chains after the first; they are verified beside it, and the
chain with the longest accepted prefix goes on (greedy requests only).
"""

from __future__ import annotations

from typing import Protocol

import torch

from sieve.sequence import Draft, Sequence

__all__ = ["Draft", "Proposer", "ProposerBase"]


class Proposer(Protocol):
    """What the Speculator asks of a proposer. `ProposerBase` gives the defaults of a proposer that drafts from tokens."""

    free: bool  # asking costs next to nothing: adaptive depth may probe it at full depth every step
    needs_hidden: str | None  # the target's hidden states it drafts from: None, "last" (each sequence's last row) or "all"
    aux_hidden_layers: tuple[int, ...]  # with "all": the residual stream after these target layers too (EAGLE-3)

    def propose(self, seqs: list[Sequence], ks: list[int], branches: list[int] | None = None) -> list[Draft]:
        """Up to ks[i] draft tokens to follow seqs[i]'s last token (each k >= 1); with `branches` (asked only of a
        proposer built for them), up to branches[i] - 1 alternative chains as well."""
        ...

    def observe_hidden(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        """After a step, `seq`'s kept hidden states ([rows, H], the first at position `start`): asked only of a proposer
        whose `needs_hidden` is set."""
        ...

    def finish(self, seq: Sequence) -> None:
        """`seq` left the engine (finished or aborted): drop its state, learn from its output."""
        ...


class ProposerBase:
    """Defaults for the Proposer protocol: not free, no hidden states, nothing to forget."""

    free = False
    needs_hidden: str | None = None
    aux_hidden_layers: tuple[int, ...] = ()

    def observe_hidden(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        pass

    def finish(self, seq: Sequence) -> None:
        pass
