"""One step's adapters: the rows each adapter serves, and the low-rank products added to a layer's projections.

Every row goes through the base projection together (one GEMM, whatever its weights' format); then, per adapter in
the step, its rows' `(x A^T) B^T` (A^T and B^T as the adapter keeps them) is added to their outputs (the SGMV idea: the rows of one adapter, one pair of
small GEMMs). Rows of one adapter are usually one run (the model runner lays a step out by sequence), and a run is
a slice, not a gather. On CUDA the step's adapters sit in slots (sieve/lora/slots.py) and one pair of Triton launches
per projection serves them all."""

from __future__ import annotations

import torch

from sieve.lora.adapter import MODULES, LoRAAdapter
from sieve.lora.sites import MODEL


class LoRABatch:
    def __init__(self, groups: list[tuple[LoRAAdapter, list[tuple[int, int]]]], device: torch.device, slots=None):
        """`slots` (CUDA: sieve/lora/slots.py LoRASlots): every adapter's rows in one launch per projection."""
        self.spans, self.device = groups, device
        self.slots, self.row_slots = slots, None
        if slots is not None:  # each row's slot (-1: the base model alone), for as many rows as the spans reach
            ids = slots.assign([adapter for adapter, _ in groups])
            rows = [-1] * max(b for _, spans in groups for _, b in spans)
            for slot, (_, spans) in zip(ids, groups):
                for a, b in spans:
                    rows[a:b] = [slot] * (b - a)
            self.row_slots = torch.tensor(rows, dtype=torch.int32, device=device)
        self.groups = []  # (adapter, slice or row-index tensor)
        for adapter, spans in groups:
            if len(spans) == 1:
                rows = slice(*spans[0])
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(device)
            self.groups.append((adapter, rows))

    @classmethod
    def of(cls, spans: list[tuple[LoRAAdapter | None, int, int]], device: torch.device, slots=None) -> "LoRABatch | None":
        """From (adapter or None, first row, end row) per scheduled item, in row order; None when no row runs one."""
        by_adapter: dict[str, tuple[LoRAAdapter, list[tuple[int, int]]]] = {}
        for adapter, a, b in spans:
            if adapter is None or a == b:
                continue
            runs = by_adapter.setdefault(adapter.fingerprint, (adapter, []))[1]
            if runs and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], b)
            else:
                runs.append((a, b))
        return cls(list(by_adapter.values()), device, slots) if by_adapter else None

    def native(self) -> tuple[list, list[int]] | None:
        """The C++ layer loop's arguments (its adapters, and (adapter, first row, end row) triples), or None where an
        adapter has no native form."""
        if any(a.native is None for a, _ in self.spans):
            return None
        triples = [v for i, (_, spans) in enumerate(self.spans) for a, b in spans for v in (i, a, b)]
        return [a.native for a, _ in self.spans], triples

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base projection of `x`, [T, out]) with each adapter's rows' low-rank product at site `module` of
        `layer` added in place: with sieve's CPU kernels, by the C++ layer loop's own kernel (the same bits either way);
        with slots, every adapter's rows in one pair of Triton launches (the dense sites; the rest by PyTorch's
        matmuls)."""
        if self.slots is not None and module in self.slots.a:
            if any((layer, module) in adapter.modules for adapter, _ in self.spans):
                if self.row_slots.shape[0] < x.shape[0]:  # rows past the last adapter's run the base model alone
                    pad = self.row_slots.new_full((x.shape[0] - self.row_slots.shape[0],), -1)
                    self.row_slots = torch.cat([self.row_slots, pad])
                self.slots.apply(layer, module, x, y, self.row_slots[: x.shape[0]])
            return y
        for (adapter, rows), (_, spans) in zip(self.groups, self.spans):
            if (layer, module) not in adapter.modules:
                continue
            if adapter.native is not None and module in MODULES:
                for start, end in spans:
                    adapter.native.apply(layer, MODULES.index(module), x, y, start, end)
                continue
            a, b = adapter.weights[(layer, module)]
            if isinstance(rows, slice):
                y[rows] += (x[rows] @ a.to(x.dtype)) @ b.to(x.dtype)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.to(x.dtype)) @ b.to(x.dtype))
        return y

    def each(self, layer: int, module: str) -> list[tuple[object, torch.Tensor, torch.Tensor]]:
        """(rows, A^T, B^T) of each adapter that changes site `module` of `layer`: for a site whose product the model
        applies in a form of its own (latent attention's absorbed kv_b_proj)."""
        return [(rows, *adapter.weights[(layer, module)]) for adapter, rows in self.groups if (layer, module) in adapter.modules]

    def embed(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`x` (the embeddings of `input_ids`) with each adapter's embed_tokens product added to its rows, in place:
        A's column of each token (a row of A^T), times B."""
        for rows, at, bt in self.each(MODEL, "embed_tokens"):
            x[rows] += at[input_ids[rows]].to(x.dtype) @ bt.to(x.dtype)
        return x

    def take(self, rows: list[int]) -> "LoRABatch | None":
        """The adapters that change the head, over step rows `rows` numbered 0 .. len(rows) - 1 (the rows the head
        scores); None where none of the step's adapters changes the head."""
        heads = [(adapter, spans) for adapter, spans in self.spans if (MODEL, "lm_head") in adapter.modules]
        if not heads:
            return None
        owner = {r: adapter for adapter, spans in heads for a, b in spans for r in range(a, b)}
        return LoRABatch.of([(owner.get(r), i, i + 1) for i, r in enumerate(rows)], self.device)

    def at(self, layer: int) -> "LayerLoRA":
        return LayerLoRA(self, layer)


class LayerLoRA:
    """A step's adapters at one layer, as the layer's modules take them: `adapt(site, x, y)` adds the products to `y`."""

    def __init__(self, batch: LoRABatch, layer: int):
        self.batch, self.layer = batch, layer

    def __call__(self, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.batch.apply(self.layer, module, x, y)

    def each(self, module: str) -> list[tuple[object, torch.Tensor, torch.Tensor]]:
        return self.batch.each(self.layer, module)
