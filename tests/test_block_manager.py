"""The block pool on its own: all-or-nothing allocation, exact frees, rollback of a table's tail."""

from __future__ import annotations

import pytest

from sieve.block_manager import BlockManager
from sieve.outputs import RequestMetrics
from sieve.sampling_params import SamplingParams
from sieve.sequence import Request, Sequence


def seq() -> Sequence:
    req = Request("r", None, [1, 2, 3], SamplingParams(), 0, RequestMetrics(0.0))
    return Sequence(request=req, index=0, arrival_order=0, token_ids=[1, 2, 3], seed=None)


def test_allocation_is_all_or_nothing_and_frees_exactly():
    bm = BlockManager(num_blocks=5, block_size=4)
    a, b = seq(), seq()
    assert bm.allocate(a, 9) and len(a.block_table) == 3  # ceil(9 / 4)
    assert bm.allocate(a, 12) and len(a.block_table) == 3  # still fits
    assert not bm.allocate(b, 12) and b.block_table == [] and bm.num_free_blocks == 2  # needs 3, nothing taken
    assert bm.allocate(b, 8)
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    bm.free(a)
    bm.free(b)
    assert sorted(bm.free_blocks) == list(range(5)) and set(bm.ref_counts) == {0}


def test_truncate_returns_the_tail_for_speculative_rollback():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq()
    bm.allocate(s, 14)  # 4 blocks: as if 5 speculative tokens were written after 9 accepted
    s.num_computed_tokens = 14
    kept = s.block_table[:3]
    bm.truncate(s, 9)  # keep 9 tokens: 3 blocks
    assert s.block_table == kept and s.num_computed_tokens == 9 and bm.num_free_blocks == 5
    bm.truncate(s, 8)  # exactly two full blocks
    assert len(s.block_table) == 2 and s.num_computed_tokens == 8
    bm.free(s)
    assert bm.num_free_blocks == 8


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq()
    bm.allocate(s, 4)
    table = list(s.block_table)
    bm.free(s)
    s.block_table = table
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(s)


def test_importing_a_prompts_rest_never_evicts_its_start():
    """A pool of 4 blocks, all cached and unreferenced: a prompt's first two (the least recently used) and two of
    another's. Importing the prompt's next two blocks with its first two kept takes the other prompt's blocks; without
    `keep` it would take the prompt's own first blocks (least recently used) and the lookup would find nothing. With
    no room beyond the kept blocks, it imports nothing."""
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    ours = bm.prompt_hashes([1, 2, 3, 4, 5, 6, 7, 8])
    theirs = bm.prompt_hashes([9, 9, 8, 8])
    assert [j for j, _ in bm.import_cached(ours[:2] + theirs)] == [0, 1, 2, 3] and bm.num_free_blocks == 4
    taken = bm.import_cached(ours[2:], keep=ours[:2])
    assert [j for j, _ in taken] == [0, 1]
    assert all(bm.cached_block(h) is not None for h in ours) and all(bm.cached_block(h) is None for h in theirs)
    assert bm.import_cached(bm.prompt_hashes([5, 5]), keep=ours) == []  # only kept blocks left to take
    assert all(bm.cached_block(h) is not None for h in ours)


def test_importing_never_evicts_the_blocks_it_skips():
    """Blocks of the imported run that the cache holds already are skipped, and must outlive the import: a pool of 4,
    the run's second block cached and the least recently used; importing the run's 3 others takes the free block and
    the other prompt's two, not it (without the protection it went first, and the lookup stopped at the gap: a
    Gemma-3 window group loaded 20 of its 32 blocks, and the prompt was computed whole)."""
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    run = bm.prompt_hashes([1, 2, 3, 4, 5, 6, 7, 8])
    other = bm.prompt_hashes([9, 9, 8, 8, 7, 7])
    bm.import_cached([run[1]])
    bm.import_cached(other[:2])
    assert [j for j, _ in bm.import_cached(run)] == [0, 2, 3]  # the free block, then the other prompt's two
    assert all(bm.cached_block(h) is not None for h in run) and all(bm.cached_block(h) is None for h in other[:2])
