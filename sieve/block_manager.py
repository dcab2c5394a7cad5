"""Accounting for the paged KV cache: a pool of fixed-size blocks, per-sequence block tables, and
the automatic prefix cache over full blocks.

The K/V tensors themselves live with the model runner; this module only decides which block
holds which tokens. Every block carries a reference count; a block is written only while its count
is 1 and it is not yet full, so sharing full blocks between sequences is safe.

Prefix caching. A full block is named by a chained hash: the hash of (the previous block's hash,
this block's token ids), rooted in a per-engine namespace (model, dtype, KV dtype, block size). So a
block is reused only when everything before it matches too. Chained hashes were chosen over a radix
tree because the pool is already block-granular: a hash per full block is one dict lookup per block,
needs no tree surgery on eviction, and gives the same longest-prefix answer at block granularity.
Blocks whose count drops to 0 keep their contents and hash and wait, least recently used first,
in `evictable`; they are handed out again (and forgotten) only when no never-cached block is free.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from sieve.sequence import Sequence


PAD = -1  # a table entry whose block was given back (it left every sliding layer's window)


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass(eq=False)
class BlockFork:
    """A copy-on-write fork of `source`'s blocks at position `start`: it shares the source's blocks before the one
    holding `start` (`shared`) and owns `blocks` from there on; `copies` (group, source block, destination) give its
    first own block the source's positions before `start` in that block. A fork is adopted, by its source (a draft
    tree's chain that verification kept) or by a new sequence (a choice forked after its sibling's prompt; a beam),
    or released. `inner`: the fork of another KV-cache group's pool; `state_slot`: a recurrent state slot of its own."""

    source: Sequence
    start: int
    shared: list[int]
    blocks: list[int]
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    inner: BlockFork | None = None
    state_slot: int = -1

    @property
    def table(self) -> list[int]:
        return self.shared + self.blocks


class BlockManager:
    GROUP = 0  # the KV-cache group this manager's pool stands for

    # Which of a sequence's tables this manager keeps, and how many of its leading blocks are in the prefix cache
    def table_of(self, seq) -> list[int]:
        return seq.block_table

    def set_table(self, seq, table: list[int]) -> None:
        seq.block_table = table

    def registered_of(self, seq) -> int:
        return seq.num_registered_blocks

    def set_registered(self, seq, n: int) -> None:
        seq.num_registered_blocks = n

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, namespace: str = ""):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # hold nothing worth keeping
        self.block_hash: list[bytes | None] = [None] * num_blocks  # set while a block is in the cache
        self.cached: dict[bytes, int] = {}  # chained hash -> block holding it
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.num_queried_tokens = 0  # prefix-cache statistics, in tokens
        self.num_hit_tokens = 0
        self.num_evictions = 0  # cached blocks handed out again for other contents
        # (chained hash, block, its tokens) of every block `commit` entered in the cache, while someone takes them
        # (the KV tiers write them down): None when nobody does
        self.new_cached: list[tuple[bytes, int, list[int]]] | None = None

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: never-cached free ones plus unreferenced cached ones."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must still take so that its table covers `num_tokens` tokens."""
        return max(0, self.blocks_needed(num_tokens - self.dropped(seq)) - len(self.table_of(seq)))

    def dropped(self, seq: Sequence) -> int:
        """Positions a press dropped from this group's slots (KV compression: token p is in slot p - dropped)."""
        return seq.kv_dropped

    def root(self, salt: str | None) -> bytes:
        """Where a sequence's chain of hashes starts: the engine's namespace, or with a cache salt (vLLM's `cache_salt`)
        a namespace of the salt's own, so that only requests with the same salt share blocks."""
        return self.root_hash if not salt else chain_hash(self.root_hash + salt.encode(), [])

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Chained hashes of `seq`'s first `num_blocks` full blocks (memoised on the sequence)."""
        hashes, bs = seq.block_hashes, self.block_size
        if len(hashes) < num_blocks:
            request = getattr(seq, "request", None)
            root = self.root(request.params.cache_salt if request is not None else None)
        while len(hashes) < num_blocks:
            j = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else root, seq.token_ids[j * bs : (j + 1) * bs]))
        return hashes[:num_blocks]

    def cached_prefix_blocks(self, seq: Sequence) -> list[int]:
        """Blocks of the longest cached prefix of `seq`, leaving at least its last token to compute
        (a step must produce logits to sample from)."""
        if not self.enable_prefix_caching:
            return []
        hit, end = [], seq.num_tokens - 1
        if seq.params.kv_compression is not None:  # tokens after a compressed prompt attend to the kept set only: their
            # exact blocks (another request's) are not this sequence's; and a step must end at its prompt, for the press
            end = min(end, seq.num_prompt_tokens - 1)
        for h in self._hashes(seq, end // self.block_size):
            block = self.cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def prompt_hashes(self, token_ids: list[int], salt: str | None = None) -> list[bytes]:
        """Chained hashes of the full blocks of `token_ids` (KV transfer names blocks by them)."""
        hashes, bs = [], self.block_size
        for j in range(len(token_ids) // bs):
            hashes.append(chain_hash(hashes[-1] if hashes else self.root(salt), token_ids[j * bs : (j + 1) * bs]))
        return hashes

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block holding `block_hash` in the prefix cache, or None."""
        return self.cached.get(block_hash) if self.enable_prefix_caching else None

    # ---- changes -------------------------------------------------------------------------
    def import_cached(self, hashes: list[bytes], keep: list[bytes] = ()) -> list[tuple[int, int]]:
        """Blocks whose contents arrive from elsewhere (KV transfer, the KV tiers), the chained hashes of a prompt's
        blocks: each one not cached yet takes a free block, named by its hash and left unreferenced in the cache, where
        the next lookup finds it. Returns (index in `hashes`, block) of the blocks the caller must fill now; stops early
        when only blocks imported by this call, or kept, would be left to take. `keep`: the hashes of the blocks
        before them that the cache holds (the start of the same prompt); they and the blocks of `hashes` the cache
        holds already are made the most recently used and never taken by this call: importing a prompt's rest must not
        evict its start, nor the blocks between that it skips."""
        if not self.enable_prefix_caching:
            return []
        taken: list[tuple[int, int]] = []
        mine: set[int] = set()
        for h in [*keep, *hashes]:  # those cached already: the most recently used, and never taken by this call
            block = self.cached.get(h)
            if block is not None:
                if block in self.evictable:
                    self.evictable.move_to_end(block)
                mine.add(block)
        for j, h in enumerate(hashes):
            if h in self.cached:
                continue
            if not self.free_blocks and (not self.evictable or next(iter(self.evictable)) in mine):
                break
            block = self._take_block()
            self.cached[h] = block
            self.block_hash[block] = h
            self.evictable[block] = None
            mine.add(block)
            taken.append((j, block))
        return taken

    def take_cached_prefix(self, seq: Sequence) -> int:
        """Before `seq`'s first step after it (re)enters: share the blocks of its longest cached prefix
        and mark those tokens computed. Returns the number of tokens taken from the cache."""
        assert not self.table_of(seq) and seq.num_computed_tokens == 0
        hit = self.cached_prefix_blocks(seq)
        self._share(seq, hit)
        seq.num_computed_tokens = len(hit) * self.block_size
        return seq.num_computed_tokens

    def _share(self, seq: Sequence, table: list[int]) -> None:
        """`seq` takes `table` (cached blocks, or PAD) as its table, all of it registered in the cache."""
        for block in table:
            if block == PAD:
                continue
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        self.set_table(seq, list(table))
        self.set_registered(seq, len(table))

    def count_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Statistics: a sequence entered the batch with `num_hit_tokens` of its tokens cached."""
        if self.enable_prefix_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s table to cover `num_tokens` tokens. All or nothing: False if short."""
        need = self.num_new_blocks(seq, num_tokens)
        if need > self.num_free_blocks:
            return False
        self.table_of(seq).extend(self._new_blocks(need))
        return True

    def fork(self, seq: Sequence, start: int, end: int) -> BlockFork | None:
        """A copy-on-write fork of `seq`'s table at position `start` with room up to position `end` (exclusive): the
        blocks before the one holding `start` shared, fresh blocks from there, and the copy of `seq`'s positions
        before `start` in that block (done by the runner in the step that writes them: before the forward pass for a
        draft chain, after it for a choice whose sibling's prompt that step computes). None (nothing changed) when the
        pool is short."""
        start, end = start - self.dropped(seq), end - self.dropped(seq)  # positions to slots (a compressed sequence)
        first = start // self.block_size
        need = max(self.blocks_needed(end), first + (1 if start % self.block_size else 0)) - first
        if need > self.num_free_blocks:
            return None
        blocks = self._new_blocks(need)
        table = self.table_of(seq)
        copies = [(self.GROUP, table[first], blocks[0])] if start % self.block_size else []
        return BlockFork(seq, start + self.dropped(seq), table[:first], blocks, copies)

    def adopt(self, seq: Sequence, f: BlockFork) -> None:
        """`seq` continues on the fork `f`. Its source: its own blocks from the one holding `start` (private to it, being
        written) give way to the fork's. Another sequence (with no blocks yet): it shares the source's blocks before
        `start` and takes the fork's, and with them the source's first `start` tokens as computed."""
        first = (f.start - self.dropped(f.source)) // self.block_size
        if seq is f.source:
            table = self.table_of(seq)
            self._forget_own(table[first:], "a draft branch replaces")
            self._release(table[first:])
            table[first:] = f.blocks
            return
        assert not self.table_of(seq)
        for block in f.shared:
            if block != PAD:
                self.ref_counts[block] += 1
        self.set_table(seq, f.shared + f.blocks)
        seq.block_hashes = list(f.source.block_hashes[:first])
        self.set_registered(seq, min(self.registered_of(f.source), first))
        seq.num_computed_tokens = f.start

    def release(self, f: BlockFork) -> None:
        """A fork not adopted: its own blocks go back."""
        self._release(f.blocks)

    def commit(self, seq: Sequence) -> None:
        """After a step: enter `seq`'s newly completed full blocks into the prefix cache. A block whose
        content another block already holds stays private (and is freed as usual)."""
        if not self.enable_prefix_caching or seq.kv_dropped or getattr(seq, "kv_cells", None) is not None:
            return  # a compressed sequence's blocks are never exact
        table = self.table_of(seq)
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        if full <= self.registered_of(seq):
            return
        hashes = self._hashes(seq, full)
        for j in range(self.registered_of(seq), full):
            block = table[j]
            if block != PAD and hashes[j] not in self.cached and self.block_hash[block] is None:
                self.cached[hashes[j]] = block
                self.block_hash[block] = hashes[j]
                if self.new_cached is not None:
                    self.new_cached.append((hashes[j], block, seq.token_ids[j * self.block_size : (j + 1) * self.block_size]))
        self.set_registered(seq, full)

    def take_new_cached(self) -> list[tuple[bytes, int, list[int]]]:
        """The blocks entered in the cache since the last call (`new_cached` on), and forget them here."""
        if self.new_cached is None:
            return []
        new, self.new_cached = self.new_cached, []
        return new

    def free(self, seq: Sequence) -> None:
        """Return all of `seq`'s blocks (finish, abort or preemption). Cached ones stay cached."""
        self._release(self.table_of(seq))
        self.set_table(seq, [])
        seq.num_computed_tokens = 0
        self.set_registered(seq, 0)
        seq.kv_compressed, seq.kv_dropped = False, 0  # preempted: its prompt is computed, and pressed, again
        if getattr(seq, "kv_cells", None) is not None:
            seq.kv_cells = None

    def compact(self, seq: Sequence, num_kept: int) -> tuple[list[int], list[int]] | None:
        """KV compression: `seq` (its prompt computed) keeps `num_kept` slots. Its new table is fresh blocks where the
        pool has them, so its prompt's exact blocks stay in the prefix cache for others (and its own next turn); the
        rest its own last blocks, out of the cache, so the cached prefix keeps its start (None, nothing changed, when
        one of those is shared). Returns (old table, new table): the runner copies the kept K/V from the one to the
        other now, before any block is written again."""
        table, need = self.table_of(seq), self.blocks_needed(num_kept)
        short = max(0, need - self.num_free_blocks)
        own = table[len(table) - short:] if short else []
        if any(self.ref_counts[b] != 1 for b in own):
            return None
        self._forget_own(own, "compact into")
        for b in own:  # referenced again by the new table before the old one lets go of them
            self.ref_counts[b] += 1
        new = self._new_blocks(need - len(own)) + own
        old = list(table)
        self._release(old)
        self.set_table(seq, new)
        self.set_registered(seq, len(new))
        return old, new

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks needed for the first `num_tokens` tokens (speculative rollback).
        Every block from the one holding token `num_tokens` on may hold rejected tokens (and the kept
        partial one will be written again), so they leave the cache; none of them may be shared."""
        slots = num_tokens - self.dropped(seq)
        keep, first_dirty = self.blocks_needed(slots), slots // self.block_size
        table = self.table_of(seq)
        self._forget_own(table[first_dirty:], "truncate into")
        self._release(table[keep:])
        del table[keep:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        self.set_registered(seq, min(self.registered_of(seq), slots // self.block_size))
        del seq.block_hashes[num_tokens // self.block_size :]

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (e.g. after weights change)."""
        while self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self._forget(block)
            self.free_blocks.append(block)

    def _forget_own(self, blocks: list[int], what: str) -> None:
        """`blocks` are about to be overwritten or replaced: out of the prefix cache. Each must be private to its
        sequence (a shared block's content is another's too)."""
        for block in blocks:
            if self.ref_counts[block] != 1:
                raise RuntimeError(f"{what} shared block {block}: only a sequence's own blocks may be rewritten")
            self._forget(block)

    def _new_blocks(self, n: int) -> list[int]:
        """`n` blocks taken from the pool, each referenced once (the caller checked there are enough)."""
        blocks = [self._take_block() for _ in range(n)]
        for block in blocks:
            assert self.ref_counts[block] == 0
            self.ref_counts[block] = 1
        return blocks

    def _take_block(self) -> int:
        if self.free_blocks:
            return self.free_blocks.popleft()
        block, _ = self.evictable.popitem(last=False)  # least recently used cached block
        self._forget(block)
        self.num_evictions += 1
        return block

    def _forget(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None

    def _release(self, blocks: list[int]) -> None:
        # Reversed, so the tail of a table (least likely to be shared later) is reused first.
        for block in reversed(blocks):
            if block == PAD:
                continue
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)


class SlidingWindowBlockManager(BlockManager):
    """The pool of the sliding-window layers (KV-cache group 1), kept in each sequence's `window` (WindowState).

    A layer with window W computes a token at position p from keys p - W < k <= p, so once a sequence's
    next token to compute is at position c, block j (positions j*bs .. (j+1)*bs - 1) is never read again
    when (j + 1) * bs <= c - W + 1. Before each allocation such blocks are given back (their entry becomes
    PAD); a cached one stays in the prefix cache (evictable) like any unreferenced block."""

    GROUP = 1

    def table_of(self, seq) -> list[int]:
        return seq.window.table

    def set_table(self, seq, table: list[int]) -> None:
        seq.window.table = table

    def registered_of(self, seq) -> int:
        return seq.window.registered

    def set_registered(self, seq, n: int) -> None:
        seq.window.registered = n

    def __init__(self, num_blocks: int, block_size: int, window: int, enable_prefix_caching: bool = False, namespace: str = ""):
        super().__init__(num_blocks, block_size, enable_prefix_caching, namespace)
        self.window = window
        self.num_window_freed = 0  # blocks given back because they left the window (statistics)

    def dropped(self, seq: Sequence) -> int:
        return 0  # a press leaves the sliding-window layers whole: their slots stay positions

    def first_needed_block(self, position: int) -> int:
        """The first block a token computed at `position` (or later) may read."""
        return max(0, position - self.window + 1) // self.block_size

    def first_kept_block(self, seq: Sequence, position: int) -> int:
        """The first block `seq` may still read once its next token to compute is at `position`: that token's
        window, and while a press is to run on its prompt, the windows of the prompt's last positions whose queries
        the press reads again (SnapKV's)."""
        if getattr(seq, "press_pending", False):
            position = min(position, seq.num_prompt_tokens - seq.params.kv_compression.lookback)
        return self.first_needed_block(position)

    def release_out_of_window(self, seq: Sequence) -> None:
        table = seq.window.table
        for j in range(min(self.first_kept_block(seq, seq.num_computed_tokens), len(table))):
            if table[j] != PAD:
                self._release([table[j]])
                table[j] = PAD
                self.num_window_freed += 1

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        self.release_out_of_window(seq)
        return super().allocate(seq, num_tokens)

    def longest_hit(self, seq: Sequence, max_blocks: int) -> int:
        """The most leading blocks h <= max_blocks (h blocks: the next token to compute is at h * bs) whose
        window is entirely in this group's cache."""
        hashes = self._hashes(seq, max_blocks)
        for h in range(max_blocks, 0, -1):
            if all(hashes[j] in self.cached for j in range(self.first_kept_block(seq, h * self.block_size), h)):
                return h
        return 0

    def take_hit(self, seq: Sequence, num_blocks: int) -> None:
        """`seq` enters with its first `num_blocks` blocks cached: share those its window needs, PAD the rest."""
        first = self.first_kept_block(seq, num_blocks * self.block_size)
        hashes = self._hashes(seq, num_blocks)
        self._share(seq, [PAD] * first + [self.cached[hashes[j]] for j in range(first, num_blocks)])


class HybridBlockManager(BlockManager):
    """KV cache in two groups, each its own pool and table per sequence: the full-attention layers' (this
    manager, `block_table`) and the sliding-window layers' (`window`, each sequence's `window.table`), which gives blocks
    back as they leave the window. A sequence holds blocks in both or in neither; a prefix-cache hit needs
    the full group's blocks of the whole prefix and the window group's blocks of its last window."""

    def __init__(self, num_blocks: int, window: SlidingWindowBlockManager, enable_prefix_caching: bool = False,
                 namespace: str = ""):
        super().__init__(num_blocks, window.block_size, enable_prefix_caching, namespace)
        self.window = window

    @property
    def usage(self) -> float:
        return max(super().usage, self.window.usage)

    def cached_prefix_blocks(self, seq: Sequence) -> list[int]:
        if getattr(seq, "query_stats", None) is not None:  # its press needs every prompt position's queries, which a
            return []  # pass over a cached prefix cannot give here: the window layers gave the blocks it reads back
        hit = super().cached_prefix_blocks(seq)
        return hit[: self.window.longest_hit(seq, len(hit))] if hit else hit

    def take_cached_prefix(self, seq: Sequence) -> int:
        assert not seq.block_table and not seq.window.table and seq.num_computed_tokens == 0
        hit = self.cached_prefix_blocks(seq)
        self._share(seq, hit)
        self.window.take_hit(seq, len(hit))
        seq.num_computed_tokens = len(hit) * self.block_size
        return seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        # all or nothing per group; blocks a group took stay with the sequence (used on the next try, freed with it)
        return super().allocate(seq, num_tokens) and self.window.allocate(seq, num_tokens)

    def fork(self, seq: Sequence, start: int, end: int) -> BlockFork | None:
        f = super().fork(seq, start, end)
        if f is None:
            return None
        f.inner = self.window.fork(seq, start, end)
        if f.inner is None:
            super().release(f)
            return None
        f.copies = f.copies + f.inner.copies
        return f

    def adopt(self, seq: Sequence, f: BlockFork) -> None:
        super().adopt(seq, f)
        self.window.adopt(seq, f.inner)

    def release(self, f: BlockFork) -> None:
        super().release(f)
        self.window.release(f.inner)

    def commit(self, seq: Sequence) -> None:
        super().commit(seq)
        self.window.commit(seq)

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self.window.free(seq)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        super().truncate(seq, num_tokens)
        self.window.truncate(seq, num_tokens)

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.window.reset_prefix_cache()


STATE_GROUP = -1  # block copies of this group copy recurrent-state slots (Mamba-2 layers), not KV blocks


class RecurrentBlockManager(BlockManager):
    """KV blocks for the attention layers, and for the recurrent (Mamba-2) layers one state slot per running
    sequence (`seq.state_slot`), taken with its first blocks and given back with them. A forked choice takes a
    slot of its own and a copy of its sibling's state after the prompt. A recurrent state cannot be rolled back
    or shared by a prefix, so such models run without speculative decoding and prefix caching (the engine
    refuses the one and turns off the other)."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int, namespace: str = ""):
        super().__init__(num_blocks, block_size, False, namespace)
        self.free_slots: deque[int] = deque(range(num_slots))
        self.num_slots = num_slots

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        if seq.state_slot < 0:
            if not self.free_slots:
                return False
            seq.state_slot = self.free_slots.popleft()
        return super().allocate(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = -1

    def fork(self, seq: Sequence, start: int, end: int) -> BlockFork | None:
        """A forked choice's blocks and a state slot of its own, given a copy of its sibling's state after the prompt."""
        if not self.free_slots:
            return None
        f = super().fork(seq, start, end)
        if f is None:
            return None
        f.state_slot = self.free_slots.popleft()
        f.copies = f.copies + [(STATE_GROUP, seq.state_slot, f.state_slot)]
        return f

    def adopt(self, seq: Sequence, f: BlockFork) -> None:
        super().adopt(seq, f)
        if seq is not f.source:
            seq.state_slot = f.state_slot

    def release(self, f: BlockFork) -> None:
        super().release(f)
        if f.state_slot >= 0:
            self.free_slots.append(f.state_slot)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        raise RuntimeError("a recurrent state cannot be rolled back: speculative decoding is off for this model")


def build_block_manager(arch, num_blocks: int, num_window_blocks: int, block_size: int, max_num_seqs: int,
                        enable_prefix_caching: bool, namespace: str):
    """The block manager a model's layers need: Mamba-2 layers a state slot per running sequence beside the KV
    blocks; sliding-window layers their own pool, freed as blocks leave the window; otherwise one pool."""
    if arch.has_recurrent_state:
        return RecurrentBlockManager(num_blocks, block_size, max_num_seqs, namespace)
    if num_window_blocks:
        window = SlidingWindowBlockManager(num_window_blocks, block_size, arch.max_window, enable_prefix_caching, namespace)
        return HybridBlockManager(num_blocks, window, enable_prefix_caching, namespace)
    return BlockManager(num_blocks, block_size, enable_prefix_caching, namespace)
