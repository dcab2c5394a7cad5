"""Verification of drafted tokens against the target's step, so the output is distributed exactly as the
target's own.

The target step gives, for each drafted position i (0..k-1) and the bonus position k, the distribution p_i
the sampler would draw from there (penalties, bans, temperature, top-k/p, min-p all applied, with the
drafts before i taken as already generated), and the token x_i the sampler drew from p_i (the argmax for
greedy rows) with that position's own seeded draw.

- Deterministic drafts (n-gram, suffix, argmax drafting: q one-hot). Leviathan et al.'s rule accepts d_i with
  probability min(1, p_i(d_i) / 1) = p_i(d_i), and on rejection draws from max(p_i - onehot(d_i), 0), which is
  p_i conditioned on "not d_i". Drawing x_i ~ p_i and accepting iff x_i == d_i is the same rule: it accepts
  with probability p_i(d_i), and when it rejects, x_i is a draw from p_i given x_i != d_i. So the emitted
  tokens are the draws the sampler would make anyway: greedy output is token-identical to no speculation,
  and so is a seeded request's (each position keeps its draw).
- Drafts with a distribution q_i (a draft model sampling at a temperature): accept d_i iff u_i < p_i(d_i) /
  q_i(d_i), else emit a draw from normalise(max(p_i - q_i, 0)) and stop; if every draft is accepted, the bonus
  token is x_k. u_i and the residual draw come from the position's seed when the request has one.
"""

from __future__ import annotations

import torch

from sieve.sampler import draw, draw_seed


def accepted_prefix(draft: list[int], target: list[int]) -> int:
    """How many leading drafted tokens equal the target's tokens at their positions."""
    a = 0
    while a < len(draft) and target[a] == draft[a]:
        a += 1
    return a


def verify_deterministic(draft: list[int], target: list[int]) -> list[int]:
    """Emitted tokens: the accepted drafts, then the target's token at the first rejection (or the bonus)."""
    a = accepted_prefix(draft, target)
    return draft[:a] + [target[a]]


def verify_with_q(draft: list[int], q: torch.Tensor, p: torch.Tensor, target: list[int], seeds: list[int | None],
                  generator: torch.Generator | None) -> list[int]:
    """Rejection sampling. q [k, V]: the draft distributions; p [k + 1, V]: the target's; target [k + 1]: the
    target's own draws; seeds [k + 1]: each position's draw seed (None: the engine's generator)."""
    for i, d in enumerate(draft):
        pd, qd = float(p[i, d]), float(q[i, d])
        if seeds[i] is None:
            u = float(torch.rand((), device=p.device, generator=generator))
        else:
            u = float(torch.rand((), device=p.device, generator=torch.Generator(device=p.device).manual_seed(
                draw_seed(seeds[i], 1, 0))))
        if u * qd < pd:  # u < p/q (q > 0: d was drawn from q)
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        if not float(residual.sum()) > 0:  # p <= q everywhere means p == q: any draw from p is exact
            residual = p[i]
        sub = None if seeds[i] is None else draw_seed(seeds[i], 2, 0)
        return draft[:i] + [int(draw(residual[None], [sub], generator)[0])]
    return list(draft) + [target[len(draft)]]
