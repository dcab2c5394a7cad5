"""Prompt lookup (n-gram) drafting: find the most recent earlier occurrence of the sequence's last n tokens
(n from `prompt_lookup_max` down to `prompt_lookup_min`) and propose the tokens that followed it; for a draft tree
(`num_branches`), the different continuations of the other matches as well.

Input-grounded tasks (summarise, extract, rewrite, edit code) copy spans of the prompt, so the continuation of
an earlier match is often the next tokens. Each sequence's tokens are kept as int32 bytes, appended as they
grow, so the search is one `bytes.rfind` per n (C speed) instead of a Python scan of the context.
"""

from __future__ import annotations

from array import array

from sieve.sequence import Sequence
from sieve.spec_decode.proposer import Draft, ProposerBase


class TokenBuffer:
    """A sequence's tokens as int32 bytes, synced incrementally (tokens are only ever appended)."""

    __slots__ = ("data", "n")

    def __init__(self) -> None:
        self.data, self.n = bytearray(), 0

    def sync(self, token_ids: list[int]) -> None:
        if len(token_ids) > self.n:
            self.data += array("i", token_ids[self.n :]).tobytes()
            self.n = len(token_ids)

    def find_last(self, pattern: list[int], end: int) -> int:
        """Start index of the last occurrence of `pattern` that ends before token `end`, or -1."""
        needle, stop = array("i", pattern).tobytes(), end * 4
        while True:
            at = self.data.rfind(needle, 0, stop)
            if at < 0 or at % 4 == 0:
                return at // 4 if at >= 0 else -1
            stop = at + len(needle) - 1  # a match across token boundaries: look further left


def lookup(buf: TokenBuffer, tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The continuation (up to k tokens) of the longest recent match of the last n tokens."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        start = buf.find_last(tokens[L - n :], L - 1)  # ends before the last token, so something follows it
        if start >= 0:
            return tokens[start + n : start + n + k]
    return []


def lookup_many(buf: TokenBuffer, tokens: list[int], k: int, n_min: int, n_max: int, width: int) -> list[list[int]]:
    """Up to `width` different continuations (up to k tokens each), for a draft tree: those of the longest n's
    matches, most recent first, then of shorter n's. The first is `lookup`'s. At most 4 x width matches are read per n."""
    L, out, seen = len(tokens), [], set()
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        end = L - 1
        for _ in range(4 * width):
            start = buf.find_last(tokens[L - n:], end)
            if start < 0:
                break
            cont = tuple(tokens[start + n: start + n + k])
            if cont not in seen:
                seen.add(cont)
                out.append(list(cont))
                if len(out) == width:
                    return out
            end = start + n - 1  # the next match ends before this one does
    return out


class NgramProposer(ProposerBase):
    free = True  # asking costs next to nothing: "auto" may probe it at full depth every step

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self.buffers: dict[Sequence, TokenBuffer] = {}

    def propose(self, seqs: list[Sequence], ks: list[int], branches: list[int] | None = None) -> list[Draft]:
        drafts = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            buf = self.buffers.get(seq)
            if buf is None:
                buf = self.buffers[seq] = TokenBuffer()
            buf.sync(seq.token_ids)
            if branches and branches[i] > 1:  # a draft tree: the continuations of other matches too
                chains = lookup_many(buf, seq.token_ids, k, self.n_min, self.n_max, branches[i])
                drafts.append(Draft(chains[0], alternatives=chains[1:]) if chains else Draft([]))
            else:
                drafts.append(Draft(lookup(buf, seq.token_ids, k, self.n_min, self.n_max)))
        return drafts

    def finish(self, seq: Sequence) -> None:
        self.buffers.pop(seq, None)
