"""What every training command shares: the learning-rate schedule and the acceptance a trained drafter would reach."""

from __future__ import annotations

import torch


def acceptance_summary(right: torch.Tensor, chain: torch.Tensor, states: int) -> dict:
    """Per draft position s: the share of `states` whose token s was right (`right`), and whose tokens 1..s all were
    (`chain`); the simulated mean acceptance length at each depth k is 1 + the chained shares up to k."""
    acc, chained = (right / max(1, states)).tolist(), (chain / max(1, states)).tolist()
    return {"head_accuracy": acc, "chain_acceptance": chained,
            "simulated_mean_acceptance_length": {str(k): 1 + sum(chained[:k]) for k in range(1, len(chained) + 1)}}


def warmup_decay(opt, steps: int):
    """The learning rate rises over the first tenth of `steps`, then falls linearly to a tenth of it (any step count,
    one included; steps past the end stay at the floor)."""
    warm = max(1, steps // 10)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: (i + 1) / warm if i < warm else max(0.1, 1 - 0.9 * (i - warm) / max(1, steps - warm)))
