"""Where a sequence with per-layer budgets (sieve/kv_compression/budgets.py) keeps each layer's kept positions.

The pool holds a block's K/V for every attention layer side by side (a layer's plane of the block). A press that
keeps a different number of positions in each layer would waste the planes of the layers that keep fewer; instead
the sequence takes `num_blocks` blocks, about the layers' mean in blocks, and each layer's kept blocks are cells
(plane, j): plane `plane` of the j-th block of the sequence's table. A layer keeps its own plane where it can and
the layers that keep more borrow the planes the others leave free. Tokens after the prompt are written as usual, from
block `num_blocks` of the table on, the same slot in every layer's plane: layer a reads its cells, then its own plane
of those blocks (its table indexes the group's pool flattened over its planes, block index plane x blocks + block).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LayerCells:
    counts: list[int]  # positions kept per attention layer (whole blocks)
    cells: list[list[tuple[int, int]]]  # per attention layer, (plane, j) of its kept blocks in order
    num_blocks: int  # leading blocks of the sequence's table that hold the kept positions

    @classmethod
    def packed(cls, counts: list[int], block_size: int) -> "LayerCells":
        need = [c // block_size for c in counts]
        L = len(need)
        m = -(-sum(need) // L)
        cells = [[(a, j) for j in range(min(n, m))] for a, n in enumerate(need)]
        free = iter([(p, j) for p in range(L) for j in range(need[p], m)])  # the planes their own layers leave
        for a, n in enumerate(need):
            cells[a] += [next(free) for _ in range(n - m)]
        return cls(list(counts), cells, m)

    @property
    def mean_kept(self) -> int:
        """Kept positions per layer, on average (what usage reports)."""
        return sum(self.counts) // len(self.counts)

    def table(self, layer: int, table: list[int], plane_blocks: int) -> list[int]:
        """Attention layer `layer`'s block table over the pool flattened across planes (`plane_blocks` blocks a
        plane), for the sequence's (or its draft fork's) `table`."""
        own = [p * plane_blocks + table[j] for p, j in self.cells[layer]]
        return own + [layer * plane_blocks + b for b in table[self.num_blocks:]]

    def context(self, layer: int, slots: int, block_size: int) -> int:
        """Layer `layer`'s length in its own table for `slots` slots of the sequence's table."""
        return slots - self.num_blocks * block_size + self.counts[layer]

    def blocks(self, layer: int, num_blocks: int) -> int:
        """Blocks of layer `layer`'s table that `num_blocks` blocks of the sequence's table cover."""
        return len(self.cells[layer]) + num_blocks - self.num_blocks
