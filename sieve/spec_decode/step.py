"""One step's speculative decoding, as the model runner lays out and verifies it (the spec-decode metadata of a
step). `SamplePlan` lists the rows a step samples: each sequence's next token, each drafted position after it
(sampled as if the drafts before it were already generated: `pending`), and a draft tree's other chains.
`verify` then keeps, per sequence, the drafted tokens the target agrees with: rejection sampling against the
draft's distribution for a sampled request that has one, the longest accepted chain of a tree, or the plain
prefix match."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sieve.sampler import SamplerOutput, logprob_dicts, logprobs_of
from sieve.sequence import Sequence
from sieve.spec_decode.rejection import verify_deterministic, verify_with_q

if TYPE_CHECKING:
    from sieve.scheduler import ScheduledSeq


@dataclass
class SampleGroup:
    """One sequence's sampled rows: `first` samples its next token, the rows after it its drafted positions; a draft
    tree's `chains` list, per chain, the sampled rows of its positions 0 .. len(draft) (a chain's first row is the
    sequence's own). `item` is None for a choice forked from the item's sequence (it samples one token)."""

    seq: Sequence
    item: ScheduledSeq | None
    first: int
    chains: list[list[int]] | None = None


@dataclass
class SamplePlan:
    seqs: list[Sequence] = field(default_factory=list)  # per sampled row: its sequence,
    pending: list[list[int]] = field(default_factory=list)  # the drafted tokens before it,
    rows: list[int] = field(default_factory=list)  # and its row of the step's hidden states
    groups: list[SampleGroup] = field(default_factory=list)

    def add(self, item: ScheduledSeq, last: int, branch_rows: list[int]) -> None:
        """`item`'s sampled rows: `last`, its last real row (once more for each choice forked from it, which samples
        from the same logits), each drafted position after it, and each other chain's drafted rows (from
        `branch_rows`, the chains' first rows)."""
        own, group = len(self.seqs), len(self.groups)
        for seq in [item.seq, *item.forks]:
            first = len(self.seqs)
            for j in range(len(item.draft) + 1 if seq is item.seq else 1):
                self._row(seq, item.draft[:j], last + j)
            self.groups.append(SampleGroup(seq, item if seq is item.seq else None, first))
        if item.branches:  # (drafts, so a decode: no forks)
            chains = [list(range(own, own + len(item.draft) + 1))]
            for branch, b_row in zip(item.branches, branch_rows):
                b_first = len(self.seqs)
                for j in range(1, branch.num_rows):
                    self._row(item.seq, branch.draft[:j], b_row + j)
                chains.append([own, *range(b_first, len(self.seqs))])
            self.groups[group].chains = chains

    def _row(self, seq: Sequence, pending: list[int], row: int) -> None:
        self.seqs.append(seq)
        self.pending.append(pending)
        self.rows.append(row)

    def with_draft_probs(self) -> bool:
        """Whether a sampled request verifies a draft against its distribution (the sampler must keep its probs)."""
        return any(g.item is not None and g.item.draft_probs is not None and not g.seq.params.greedy for g in self.groups)


def verify(plan: SamplePlan, out: SamplerOutput, seeds, generator) -> tuple[list[tuple], list[int]]:
    """Per group (sequence, the tokens it emits, their logprob dicts), and the sampled row of each one's last emitted
    token. `seeds`: the sampling metadata's per-row seeds (rejection sampling draws with them)."""
    targets = out.token_ids.tolist()
    lp_dicts = logprob_dicts(out, [s.params.logprobs for s in plan.seqs])
    result, last_rows = [], []
    for g in plan.groups:
        seq, item, first = g.seq, g.item, g.first
        if item is None or not item.draft:
            result.append((seq, [targets[first]], [lp_dicts[first]]))
            last_rows.append(first)
            continue
        k, target = len(item.draft), targets[first : first + len(item.draft) + 1]
        if item.draft_probs is not None and not seq.params.greedy:
            emitted = verify_with_q(item.draft, item.draft_probs, out.probs[first : first + k + 1], target,
                                    seeds[first : first + k + 1], generator)
            n = seq.params.logprobs
            if emitted[-1] != target[len(emitted) - 1] and n is not None:  # a residual draw: report it, not the target's
                i = first + len(emitted) - 1
                chosen = torch.tensor([emitted[-1]], device=out.token_ids.device)
                lp_dicts[i] = logprob_dicts(logprobs_of(out.raw_logprobs[i : i + 1], chosen, n), [n])[0]
        elif g.chains is not None:  # a draft tree: the chain with the longest accepted prefix goes on (the first of equals)
            drafts = [item.draft] + [b.draft for b in item.branches]
            verified = [verify_deterministic(d, [targets[i] for i in rows]) for d, rows in zip(drafts, g.chains)]
            item.chain_accepted = [len(v) - 1 for v in verified]
            item.chosen_branch = max(range(len(drafts)), key=lambda c: (len(verified[c]), -c))
            emitted, rows = verified[item.chosen_branch], g.chains[item.chosen_branch]
            result.append((seq, emitted, [lp_dicts[i] for i in rows[: len(emitted)]]))
            last_rows.append(rows[len(emitted) - 1])
            continue
        else:
            emitted = verify_deterministic(item.draft, target)
        result.append((seq, emitted, lp_dicts[first : first + len(emitted)]))
        last_rows.append(first + len(emitted) - 1)
    return result, last_rows
