"""KV compression: a sequence keeps a subset of its prompt's positions per layer and KV head, chosen by a press
after its prompt's prefill, rewritten compactly into its own blocks (sieve/kv_compression/compact.py).

A request asks with `kv_compression: {"press": "snapkv", "ratio": 0.5}` (offline: SamplingParams(kv_compression=
...)), or takes the server's `--kv-compression PRESS:RATIO`; `"budgets": "entropy"` (`PRESS:RATIO:entropy`) shares
the same total between the layers by their attention entropy (sieve/kv_compression/budgets.py). `ratio` is kvpress's `compression_ratio`: the fraction
of the prompt's positions removed (0.5 keeps half, 0.75 a quarter). Lossy: docs/kv-compression.md gives each
press's measured cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sieve.kv_compression.chunkkv import ChunkKVPress
from sieve.kv_compression.expected_attention import ExpectedAttentionPress
from sieve.kv_compression.knorm import KnormPress
from sieve.kv_compression.press import LayerKV, Press
from sieve.kv_compression.snapkv import SnapKVPress
from sieve.kv_compression.streaming_llm import StreamingLLMPress

BUDGETS = ("uniform", "entropy")
PRESSES: dict[str, type[Press]] = {p.name: p for p in (StreamingLLMPress, KnormPress, ExpectedAttentionPress, SnapKVPress,
                                                       ChunkKVPress)}

__all__ = ["KVCompression", "LayerKV", "Press", "PRESSES"]


@dataclass(frozen=True)
class KVCompression:
    """A request's press and ratio (the fraction of its prompt's positions removed, in (0, 1))."""

    press: str
    ratio: float
    budgets: str = "uniform"  # or "entropy": per-layer shares of the same total (sieve/kv_compression/budgets.py)

    def __post_init__(self) -> None:
        if self.press not in PRESSES:
            raise ValueError(f"kv_compression.press: unknown press {self.press!r}; one of {', '.join(PRESSES)}")
        if self.budgets not in BUDGETS:
            raise ValueError(f"kv_compression.budgets: {self.budgets!r} is not one of {', '.join(BUDGETS)}")
        if self.budgets == "entropy" and self.press == "chunkkv":
            raise ValueError("kv_compression: chunkkv keeps one count in every layer (it reuses a layer's chunks in the "
                             "next); entropy budgets take another press")
        r = self.ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not 0 < r < 1:
            raise ValueError(f"kv_compression.ratio must be a number in (0, 1) (the fraction of positions removed), got {r!r}")

    @classmethod
    def of(cls, value) -> "KVCompression":
        """From a KVCompression, a {"press": ..., "ratio": ...[, "budgets": ...]} object or a "press:ratio[:budgets]"
        string."""
        if isinstance(value, KVCompression):
            return value
        if isinstance(value, str):
            press, sep, rest = value.partition(":")
            ratio, _, budgets = rest.partition(":")
            try:
                return cls(press.strip(), float(ratio) if sep else float("nan"), budgets.strip() or "uniform")
            except ValueError as e:
                if "kv_compression" in str(e):
                    raise
                raise ValueError(f"kv_compression: {value!r} is not PRESS:RATIO[:BUDGETS] (e.g. snapkv:0.5)") from None
        if isinstance(value, dict):
            extra = set(value) - {"press", "ratio", "budgets"}
            if extra or "press" not in value or "ratio" not in value:
                raise ValueError("kv_compression takes {\"press\": NAME, \"ratio\": FRACTION_REMOVED[, \"budgets\": "
                                 "\"uniform\" | \"entropy\"]}" + (f"; unknown field {sorted(extra)[0]!r}" if extra else ""))
            if not isinstance(value["press"], str) or not isinstance(value.get("budgets", ""), str):
                raise ValueError("kv_compression.press and .budgets must be strings")
            return cls(value["press"], value["ratio"], value.get("budgets", "uniform"))
        raise ValueError(f"kv_compression must be an object {{press, ratio}}, got {type(value).__name__}")

    def make(self) -> Press:
        """A fresh press for one sequence."""
        return PRESSES[self.press]()

    @property
    def lookback(self) -> int:
        """The prompt's last positions whose queries the press reads again after the prefill (SnapKV's window)."""
        return self.make().query_window

    def n_kept(self, num_tokens: int) -> int:
        """Positions kept of a prompt of `num_tokens` (kvpress's int(T * (1 - ratio)), at least one)."""
        return max(1, int(num_tokens * (1 - self.ratio)))

    def __str__(self) -> str:
        return f"{self.press}:{self.ratio:g}" + (f":{self.budgets}" if self.budgets != "uniform" else "")
