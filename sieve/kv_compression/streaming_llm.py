"""StreamingLLM (Xiao et al., 2023): the first `n_sink` positions (attention sinks) and the most recent ones.
Question-agnostic. The same positions as kvpress's StreamingLLMPress."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sieve.kv_compression.press import LayerKV, Press


@dataclass
class StreamingLLMPress(Press):
    name = "streaming_llm"
    n_sink: int = 4

    def min_prompt(self) -> int:
        return self.n_sink + 1

    def keep(self, kv: LayerKV, n_kept: int) -> torch.Tensor:
        T, heads = kv.keys.shape[1], kv.keys.shape[0]
        sinks = min(self.n_sink, n_kept)
        kept = torch.cat([torch.arange(sinks), torch.arange(T - (n_kept - sinks), T)])
        return kept.to(kv.keys.device).expand(heads, -1)
