"""OpenAI's /v1/embeddings: the request body and the response, over the engine's pooled hidden states
(sieve/pooling.py)."""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sieve.outputs import RequestOutput


class EmbeddingRequest(BaseModel):
    """An unknown field is a 400 naming it, as on every route."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _no_empty_input(cls, p):
        if p == "" or (isinstance(p, list) and (not p or any(x == "" or x == [] for x in p))):
            raise ValueError("an input must not be empty")
        return p

    def prompts(self) -> list[str | dict]:
        p = self.input
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": p}]
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of little-endian float32 (what its client asks for by default)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def embedding_response(finals: list[RequestOutput], model_name: str, encoding_format: str) -> dict:
    tokens = sum(len(o.prompt_token_ids) for o in finals)
    return {"object": "list", "model": model_name,
            "data": [{"object": "embedding", "index": i, "embedding": encode(o.embedding, encoding_format)}
                     for i, o in enumerate(finals)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
