"""Accounting for the paged KV cache: a pool of fixed-size blocks and per-sequence block tables.

The K/V tensors themselves live with the model runner; this module only decides which block
holds which tokens. Every block carries a reference count so that later features can share full
blocks between sequences (prefix caching) and a sequence can give back its tail blocks after
speculative tokens are rejected (`truncate`). A block is written only while its count is 1.
"""

from __future__ import annotations

from collections import deque

from sieve.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must still take so that its table covers `num_tokens` tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    # ---- changes -------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s table to cover `num_tokens` tokens. All or nothing: False if short."""
        need = self.num_new_blocks(seq, num_tokens)
        if need > len(self.free_blocks):
            return False
        for _ in range(need):
            block = self.free_blocks.popleft()
            assert self.ref_counts[block] == 0
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        """Return all of `seq`'s blocks (finish, abort or preemption)."""
        self._release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks needed for the first `num_tokens` tokens (speculative rollback)."""
        keep = self.blocks_needed(num_tokens)
        self._release(seq.block_table[keep:])
        del seq.block_table[keep:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def _release(self, blocks: list[int]) -> None:
        # Reversed, so the tail of a table (least likely to be shared later) is reused first.
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
