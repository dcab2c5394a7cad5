"""Suffix decoding (after Arctic Inference's): draft from the longest match of the sequence's recent tokens in
its own prompt and output so far, and in the outputs of past requests, choosing each next token by how often it
followed that context.

A suffix tree answers "where did this context occur, and what followed" in time independent of the history's
size. This index answers the same question at bounded depth with less machinery: every bigram maps to its most
recent occurrences (`MAX_OCCURRENCES` per bigram); a lookup extends each occurrence backwards to its match
length (up to `max_tree_depth`), keeps the longest matches, and walks forwards token by token taking the most
frequent continuation among them, as a suffix tree's frequency-weighted path would. It stops when the path's
estimated probability (product of the chosen tokens' frequencies) falls below `min_token_prob`.

Past outputs live in one global index holding the last `max_cached_requests` requests; a request's own prompt
and tokens live in a per-sequence index, updated as it grows.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from sieve.sequence import Sequence
from sieve.spec_decode.proposer import Draft, ProposerBase

MAX_OCCURRENCES = 64


class _Doc:
    __slots__ = ("tokens", "start", "alive")

    def __init__(self, tokens: list[int], start: int = 1):
        self.tokens, self.start, self.alive = tokens, start, True  # start: first position indexed


class BigramIndex:
    """Occurrences of bigrams in a set of token lists: (a, b) -> recent (doc, index of b)."""

    def __init__(self) -> None:
        self.where: dict[tuple[int, int], deque] = {}

    def add(self, doc: _Doc, start: int, end: int) -> None:
        """Index the bigrams ending at positions start..end-1 of doc (start >= 1)."""
        t, where = doc.tokens, self.where
        for i in range(max(start, 1), end):
            key = (t[i - 1], t[i])
            occ = where.get(key)
            if occ is None:
                occ = where[key] = deque(maxlen=MAX_OCCURRENCES)
            occ.append((doc, i))

    def occurrences(self, key: tuple[int, int]):
        return self.where.get(key, ())


class SuffixProposer(ProposerBase):
    free = True  # asking costs next to nothing: "auto" may probe it at full depth every step

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 1000, min_token_prob: float = 0.1):
        self.max_depth, self.max_cached, self.min_prob = max_tree_depth, max_cached_requests, min_token_prob
        self.global_index = BigramIndex()
        self.global_docs: OrderedDict[int, _Doc] = OrderedDict()  # past outputs, oldest first
        self.local: dict[Sequence, tuple[BigramIndex, _Doc, list[int]]] = {}  # seq -> (index, doc, [indexed up to])
        self._next_doc = 0
        self._evicted = 0  # since the global index was last rebuilt

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [Draft(self._propose(seq, k)) for seq, k in zip(seqs, ks)]

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        state = self.local.get(seq)
        if state is None:
            state = self.local[seq] = (BigramIndex(), _Doc(seq.token_ids), [0])
        index, doc, done = state  # doc.tokens is seq.token_ids itself: it grows in place
        ctx = seq.token_ids
        L = len(ctx)
        if L < 2:
            return []
        # The bigram ending at the last token is indexed after the search, so a match never is the context itself.
        index.add(doc, done[0], L - 1)
        done[0] = max(done[0], L - 1)
        key = (ctx[-2], ctx[-1])
        best, cands = 0, []
        for source in (index.occurrences(key), self.global_index.occurrences(key)):
            for d, i in source:
                if not d.alive or i + 1 >= len(d.tokens):
                    continue
                m = self._match_length(d.tokens, i, ctx)
                if m > best:
                    best, cands = m, [(d.tokens, i)]
                elif m == best:
                    cands.append((d.tokens, i))
        draft, prob = [], 1.0
        for j in range(1, k + 1):
            counts: dict[int, int] = {}
            for t, i in cands:
                if i + j < len(t):
                    counts[t[i + j]] = counts.get(t[i + j], 0) + 1
            if not counts:
                break
            token, c = max(counts.items(), key=lambda kv: kv[1])
            prob *= c / sum(counts.values())
            if prob < self.min_prob:
                break
            draft.append(token)
            cands = [(t, i) for t, i in cands if i + j < len(t) and t[i + j] == token]
        return draft

    def _match_length(self, t: list[int], i: int, ctx: list[int]) -> int:
        """How many tokens ending at t[i] equal the tokens ending ctx (at least the bigram), up to the depth."""
        m, limit = 2, min(self.max_depth, i + 1, len(ctx))
        while m < limit and t[i - m] == ctx[-1 - m]:
            m += 1
        return m

    def reset(self) -> None:
        """Forget every past output (the global index); sequences in flight keep their own."""
        self.global_index, self.global_docs, self._evicted = BigramIndex(), OrderedDict(), 0

    def finish(self, seq: Sequence) -> None:
        """Index the finished sequence's output (with the context just before it) for later requests."""
        self.local.pop(seq, None)
        if seq.num_output_tokens < 2:
            return
        doc = _Doc(list(seq.token_ids), seq.num_prompt_tokens)
        self.global_index.add(doc, doc.start, len(doc.tokens))
        self.global_docs[self._next_doc] = doc
        self._next_doc += 1
        while len(self.global_docs) > self.max_cached:
            _, old = self.global_docs.popitem(last=False)
            old.alive = False  # its occurrences are skipped, and age out of the bounded deques
            self._evicted += 1
        if self._evicted >= self.max_cached:  # drop bigrams that only dead documents held
            self.global_index, self._evicted = BigramIndex(), 0
            for d in self.global_docs.values():
                self.global_index.add(d, d.start, len(d.tokens))
