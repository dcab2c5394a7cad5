"""What a press sees and returns: one attention layer's prompt K/V (and, for a press that asks, the queries of the
prompt's last positions), and the positions each KV head keeps.

A press keeps the same number of positions in every layer and KV head (`n_kept`, kvpress's `int(T * (1 - ratio))`),
so a compressed sequence has one length in slots, one block table and one offset between its positions and its slots;
which positions a head keeps is its own. With entropy budgets (budgets.py) each layer keeps its own count, in whole
blocks packed across the pool's layer planes (cells.py); the keys are still chosen by the press.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class LayerKV:
    """One attention layer's view of a prompt, float32: `keys` and `values` [KVH, T, D] as cached (keys rotated),
    `queries` [H, w, D] of the prompt's last w positions (rotated; None unless the press has a `query_window`),
    `scale` the layer's attention scale, `layer` its index among the attention layers. For a press with
    `query_stats_from`: `query_mean` [H, D] and `query_cov` [H, D, D] of the prompt's queries before rotation from
    that position on, and `future_rotation` [D, D], the rotation of the press's `future_positions` after the prompt
    averaged."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None
    scale: float
    layer: int
    query_mean: torch.Tensor | None = None
    query_cov: torch.Tensor | None = None
    future_rotation: torch.Tensor | None = None


class Press:
    """A press scores a prompt's positions after its prefill, layer by layer; `keep` returns [KVH, n_kept] ascending
    positions. A press object serves one sequence (a press may carry state from one layer to the next)."""

    name: ClassVar[str]
    question_aware: ClassVar[bool] = False  # its choice depends on the prompt's last tokens (the question)
    query_window: int = 0  # the prompt's last positions whose queries it reads (0: none)
    query_stats_from: int | None = None  # reads the statistics of the prompt's queries from this position on
    future_positions: int = 0  # (with them) the positions after the prompt its `future_rotation` averages

    def min_prompt(self) -> int:
        """The shortest prompt this press can score (shorter ones keep every position)."""
        return self.query_window + 1

    def score(self, kv: LayerKV) -> torch.Tensor:
        """[KVH, T] (higher is kept first)."""
        raise NotImplementedError

    def keep(self, kv: LayerKV, n_kept: int) -> torch.Tensor:
        return self.score(kv).topk(n_kept, dim=-1).indices.sort(dim=-1).values
