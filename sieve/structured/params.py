"""What a request asks its output to match: vLLM's `StructuredOutputsParams` (exactly one of its constraints)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None  # a JSON schema (dict or its text)
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # Lark, or llama.cpp's GBNF (EBNF)
    json_object: bool = False  # any JSON object

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        set_ = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(set_) or 'none'}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured outputs `choice` must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured outputs `json` is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured outputs `json` must be a JSON schema (an object)")
            object.__setattr__(self, "json", schema)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs `{name}` must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The hash grammars are cached by: the kind and its canonical value."""
        value: Any = getattr(self, self.kind)
        text = json.dumps([self.kind, value], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()
