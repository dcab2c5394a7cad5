"""Embeddings: a request that asks for its prompt's pooled final hidden states instead of generated tokens.

Such a request is prefilled like any other, its chunks scheduled beside decodes in the same steps; as each chunk
runs, the model runner hands its rows (the hidden states after the final norm, what the LM head reads) to the
request's `Pooler`, which keeps a float32 running sum and the last row. The request ends once its prompt is computed
(as one that only scores its prompt does), and its output carries the embedding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

POOLING = ("mean", "last")


@dataclass(frozen=True)
class PoolingParams:
    """`pooling`: "mean" over every prompt position (the prefix cache is bypassed: its blocks hold keys and values,
    not hidden states) or the "last" position's; `normalize`: scaled to unit length (OpenAI's embeddings are)."""

    pooling: str = "mean"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling not in POOLING:
            raise ValueError(f"pooling must be one of {', '.join(POOLING)}, got {self.pooling!r}")

    @property
    def whole_prompt(self) -> bool:
        """Every prompt position's hidden state is needed (none may come from the prefix cache)."""
        return self.pooling == "mean"


class Pooler:
    """One request's pooled hidden states, accumulated over its prefill chunks. A chunk recomputed after a
    preemption adds nothing twice: rows before `next_position` are skipped."""

    def __init__(self, params: PoolingParams, num_prompt_tokens: int):
        self.params, self.num_prompt_tokens = params, num_prompt_tokens
        self.total: torch.Tensor | None = None  # float32 [hidden]
        self.last: torch.Tensor | None = None
        self.next_position = 0

    def add(self, start: int, rows: torch.Tensor) -> None:
        """The hidden states [n, hidden] of prompt positions start .. start + n - 1 (positions past the prompt, or
        already counted, are ignored)."""
        lo, hi = max(start, self.next_position), min(start + rows.shape[0], self.num_prompt_tokens)
        if hi <= lo:
            return
        rows = rows[lo - start: hi - start].float()
        if self.params.pooling == "mean":
            part = rows.sum(dim=0)
            self.total = part if self.total is None else self.total + part
        if hi == self.num_prompt_tokens:
            self.last = rows[-1]
        self.next_position = hi

    @property
    def done(self) -> bool:
        return self.next_position >= self.num_prompt_tokens

    def result(self) -> list[float]:
        """The embedding, once every prompt position has been added."""
        if not self.done:
            raise RuntimeError(f"pooled {self.next_position} of {self.num_prompt_tokens} prompt positions")
        vec = self.total / self.num_prompt_tokens if self.params.pooling == "mean" else self.last
        if self.params.normalize:
            vec = torch.nn.functional.normalize(vec, dim=0)
        return vec.cpu().tolist()
