"""The prefix cache's bookkeeping: block hashes chained over tokens and media, cached blocks
that outlive their sequences, lookups of the longest cached prefix, and eviction of the least
recently freed when the pool needs blocks."""

from __future__ import annotations

import pytest

from areno.engine.block_manager import BlockManager, block_hashes
from areno.media.samples import write_image
from tests.engine.generating import GREEDY, arrive_together, run, text, with_media

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


# --- the engine: prompts that start from cached blocks --------------------------------------


def _cached_tokens(gen, x, params=GREEDY) -> tuple[list[int], int]:
    """Run `x` alone; its tokens and how many of its prompt tokens the prefix cache held."""
    before = gen.stats()["num_prompt_tokens_cached"]
    (output,) = run(arrive_together(gen, [x], params))
    return output.samples[0].token_ids, gen.stats()["num_prompt_tokens_cached"] - before


def test_prompts_start_from_their_cached_prefix_media_included_and_equal_generate(
    setups, media, overlap, tmp_path
):
    """A follow-up turn with the first turn's image and text prefills only past the blocks the
    first turn left cached, chunked through the rest; the same question about another image of
    the same size shares only the blocks before the image; every answer is transformers'.
    Qwen3-VL: the tiny family whose every layer is full attention."""
    setup = setups("qwen3_vl")
    other = str(write_image(tmp_path / "other.png", 64, 48, seed=7))
    first = with_media("image", media["image"], "Describe it, please, in a few words.")
    follow_up = first + [
        {"role": "assistant", "content": "A small picture."},
        {"role": "user", "content": "And its colours?"},
    ]
    inputs = [setup.encode(m) for m in (first, follow_up)]
    inputs.append(setup.encode(with_media("image", other, "Describe it, please, in a few words.")))
    expected = [setup.reference(x, GREEDY.max_tokens) for x in inputs]
    block = 4
    gen = setup.generator(
        block_size=block,
        enable_prefix_caching=True,
        overlap_steps=overlap,
        max_prefill_tokens_per_step=16,
    )
    try:
        assert gen.core.scheduler.config.enable_prefix_caching
        results = [_cached_tokens(gen, x) for x in inputs]
        again = _cached_tokens(gen, inputs[0])
    finally:
        gen.shutdown()
    for i, ((tokens, _), want) in enumerate(zip(results, expected, strict=True)):
        assert tokens == want, (i, tokens, want)
    assert results[0][1] == 0
    (span,) = inputs[0].mm_spans
    pairs = zip(inputs[0].input_ids, inputs[1].input_ids, strict=False)
    shared = next((i for i, (a, b) in enumerate(pairs) if a != b), inputs[0].num_prompt_tokens)
    assert span.end < shared
    assert (
        results[1][1] == shared // block * block
    )  # past the image, to the turns' last shared block
    assert results[2][1] == span.start // block * block  # the other image never matches
    assert again == (expected[0], (inputs[0].num_prompt_tokens - 1) // block * block)


def test_models_with_linear_or_sliding_layers_leave_the_cache_off(setups):
    for family in ("qwen3_5", "minicpmv4_6", "gemma4"):
        gen = setups(family).generator(enable_prefix_caching=True)
        try:
            assert not gen.core.scheduler.config.enable_prefix_caching
        finally:
            gen.shutdown()


def test_new_weights_forget_the_cached_blocks(setups):
    setup = setups("qwen3_vl")
    x = setup.encode(text("Once upon a time there was a river that ran to the sea."))
    gen = setup.generator(block_size=4, enable_prefix_caching=True)
    try:
        _cached_tokens(gen, x)
        assert gen.core.scheduler.blocks.num_cached > 0
        weights = {name: p.detach().clone() for name, p in setup.model.named_parameters()}
        run(gen.update_weights(weights, 1))
        assert gen.core.scheduler.blocks.num_cached == 0
        assert _cached_tokens(gen, x)[1] == 0
    finally:
        gen.shutdown()
