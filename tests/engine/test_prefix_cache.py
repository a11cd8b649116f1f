"""The prefix cache's bookkeeping: block hashes chained over tokens and media, cached blocks
that outlive their sequences, lookups of the longest cached prefix, and eviction of the least
recently freed when the pool needs blocks."""

from __future__ import annotations

import pytest

from areno.engine.block_manager import BlockManager, block_hashes

TOKENS = list(range(100, 140))  # 2 full blocks of 16 and 8 tokens more


def test_only_full_blocks_are_hashed_and_each_hash_chains_the_ones_before():
    hashes = block_hashes(TOKENS, 16)
    assert len(hashes) == 2 and len(set(hashes)) == 2
    assert block_hashes(TOKENS[:32], 16) == hashes
    # A different first block changes the second block's hash too, though its tokens match.
    other = block_hashes([7] + TOKENS[1:], 16)
    assert other[0] != hashes[0] and other[1] != hashes[1]
    # A prefix computed elsewhere continues as if hashed whole.
    assert block_hashes(TOKENS[16:], 16, parent=hashes[0]) == hashes[1:]


def test_two_media_items_behind_the_same_placeholders_never_share_a_block():
    image_a = [(4, 20, "sha-a")]  # spans the end of block 0 and the start of block 1
    with_a = block_hashes(TOKENS, 16, image_a)
    with_b = block_hashes(TOKENS, 16, [(4, 20, "sha-b")])
    assert with_a[0] != with_b[0] and with_a[1] != with_b[1]
    assert block_hashes(TOKENS, 16, image_a) == with_a
    # An item outside a block leaves that block's hash as text alone would have it.
    later = block_hashes(TOKENS, 16, [(18, 30, "sha-a")])
    assert later[0] == block_hashes(TOKENS, 16)[0] and later[1] != block_hashes(TOKENS, 16)[1]


def test_a_freed_block_stays_cached_until_the_pool_needs_it():
    blocks = BlockManager(4, 16)
    hashes = block_hashes(TOKENS, 16)
    table = blocks.allocate(3)
    for block, h in zip(table, hashes, strict=False):
        blocks.register(block, h)
    blocks.free(table)
    assert blocks.num_free == 4 and blocks.num_cached == 2
    hit = blocks.lookup(hashes + [b"never"])
    assert hit == table[:2]
    assert blocks.acquire(hit) == hit
    assert blocks.num_free == 2 and all(blocks.num_refs(b) == 1 for b in hit)
    # Held by another table too, then let go by both: cached again, not free twice.
    blocks.acquire(hit)
    blocks.free(hit)
    blocks.free(hit)
    assert blocks.num_free == 4 and blocks.lookup(hashes) == hit


def test_eviction_takes_uncached_blocks_first_then_the_least_recently_freed_tail_first():
    blocks = BlockManager(5, 16)
    first, second = blocks.allocate(2), blocks.allocate(2)
    first_hashes = block_hashes(TOKENS, 16)
    second_hashes = block_hashes([1] + TOKENS[1:], 16)
    for table, hashes in ((first, first_hashes), (second, second_hashes)):
        for block, h in zip(table, hashes, strict=True):
            blocks.register(block, h)
    blocks.free(first)
    blocks.free(second)
    assert blocks.allocate(1) == [5]  # never cached
    # The first table's blocks were freed first; of them its tail goes before its head.
    assert blocks.allocate(1) == [first[1]]
    assert blocks.lookup(first_hashes) == first[:1]
    assert blocks.allocate(1) == [first[0]]
    assert blocks.lookup(first_hashes) == [] and blocks.lookup(second_hashes) == second
    assert blocks.num_cached == 2


def test_a_hash_keeps_its_first_block_and_a_block_its_first_hash():
    blocks = BlockManager(3, 16)
    a, b = blocks.allocate(2)
    h0, h1 = block_hashes(TOKENS, 16)
    blocks.register(a, h0)
    blocks.register(b, h0)  # the same prefix computed twice at once
    blocks.register(a, h1)
    assert blocks.lookup([h0]) == [a] and blocks.lookup([h1]) == []
    blocks.free([a, b])
    assert blocks.num_free == 3 and blocks.num_cached == 1


def test_acquiring_a_block_that_is_not_cached_is_an_error():
    blocks = BlockManager(2, 16)
    (block,) = blocks.allocate(1)
    with pytest.raises(AssertionError):
        blocks.acquire([block])
