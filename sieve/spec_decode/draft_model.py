"""Draft-model speculation: a smaller checkpoint with the same tokenizer drafts k tokens greedily (so q is one-hot
and verification keeps exactly the target's tokens or distribution), with its own paged KV.

The draft runs as a second engine, built by the target engine and handed in (`make_engine`), so this module
needs nothing of the engine's internals. Each step, every drafting sequence becomes one greedy request of k
tokens on it, all batched together; its prefix cache keeps each sequence's context between steps, so a step
recomputes only the tokens after the last full block (the accepted tokens and a partial block), then decodes k.
"""

from __future__ import annotations

import itertools

from sieve.sampling_params import SamplingParams
from sieve.sequence import Sequence
from sieve.spec_decode.proposer import Draft, ProposerBase


class DraftModelProposer(ProposerBase):
    free = False  # every token drafted costs a draft-model step

    def __init__(self, engine):
        self.engine = engine
        self._ids = itertools.count()

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        eng, rids = self.engine, []
        for seq, k in zip(seqs, ks):
            rid = f"draft-{next(self._ids)}"
            eng.add_request(rid, {"prompt_token_ids": seq.token_ids}, SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))
            rids.append(rid)
        drafted: dict[str, list[int]] = {}
        try:
            while eng.has_unfinished():
                for out in eng.step():
                    if out.finished:
                        drafted[out.request_id] = out.outputs[0].token_ids
        finally:
            for rid in rids:
                if rid not in drafted:
                    eng.abort(rid)
        return [Draft(drafted.get(rid, [])) for rid in rids]

    def finish(self, seq: Sequence) -> None:
        pass
