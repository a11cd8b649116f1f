"""The prefix cache's bookkeeping: block hashes chained over tokens and media, cached blocks
that outlive their sequences, lookups of the longest cached prefix, and eviction of the least
recently freed when the pool needs blocks."""

from __future__ import annotations

import asyncio
import copy
import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from areno.engine.config import EngineConfig
from areno.engine.kv.block_manager import BlockManager, block_hashes, partial_block_hash
from areno.engine.kv.state_cache import StateCache
from areno.engine.parallel.kv_pool import saved_state_rows
from areno.engine.runner import model_runner
from areno.engine.runner.encoder_cache import EncoderCache
from areno.engine.runner.prompt_chunks import RecentStaged, StagedPrompt
from areno.engine.sampling import SamplingParams
from areno.errors import ConfigError
from areno.media.samples import write_audio, write_image, write_video
from areno.train.policy import sequence_logprobs
from tests.engine.generating import (
    FAMILIES,
    GREEDY,
    arrive_together,
    frames_compiled,
    run,
    text,
    with_media,
)

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


def test_a_partial_block_hash_differs_from_a_full_blocks_and_names_its_media():
    full = block_hashes(TOKENS[:16], 16)[0]
    assert partial_block_hash(TOKENS[:16]) != full
    assert partial_block_hash(TOKENS[:5], parent=full) != partial_block_hash(TOKENS[:5])
    with_a = partial_block_hash(TOKENS[:5], [(2, 9, "sha-a")])
    assert with_a != partial_block_hash(TOKENS[:5], [(2, 9, "sha-b")])


def test_saved_states_are_found_after_their_blocks_and_evicted_least_recently_used():
    states = StateCache(2)
    a = states.add(b"h1", 16, None)
    b = states.add(b"h1", 19, b"tail")
    assert {a.row, b.row} == {0, 1}
    assert states.add(b"h1", 16, None) is None  # known: touched, not saved again
    assert states.after(b"h1") == [a, b] and states.after(b"h2") == []
    c = states.add(b"h2", 32, None)  # b was used least recently
    assert c.row == b.row and states.after(b"h1") == [a]
    states.discard(a)
    assert len(states) == 1 and states.after(b"h1") == []
    states.clear()
    assert len(states) == 0 and states.after(b"h2") == []
    assert states.add(b"x", 4, None).row in (0, 1)  # every row free again


# --- the engine: prompts that start from cached blocks --------------------------------------


def _cached_tokens(gen, x, params=GREEDY) -> tuple[list[int], int]:
    """Run `x` alone; its tokens and how many of its prompt tokens the prefix cache held. The
    request's own counters (what a GRPO step's prefill metrics sum) equal the engine's."""
    before = gen.stats()
    (output,) = run(arrive_together(gen, [x], params))
    after = gen.stats()
    cached = after["num_prompt_tokens_cached"] - before["num_prompt_tokens_cached"]
    admitted = after["num_prompt_tokens_admitted"] - before["num_prompt_tokens_admitted"]
    assert (output.num_prefill_tokens, output.num_cached_tokens) == (admitted, cached)
    return output.samples[0].token_ids, cached


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
        max_num_batched_tokens=16,
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


def _one_pixel_off(path: Path, out: Path) -> str:
    image = np.array(Image.open(path))
    image[0, 0, 0] ^= 1
    Image.fromarray(image).save(out)
    return str(out)


def _tool_image(url: str, kind: str = "image") -> list[dict]:
    part = {"type": f"{kind}_url", f"{kind}_url": {"url": url}}
    content = [part, {"type": "text", "text": "Here it is."}]
    return [{"role": "tool", "tool_call_id": "call_1", "content": content}]


class _TowerCalls:
    """Within the block, counts the calls that reach the model's media feature methods (the
    towers; the encoder cache's answers never do)."""

    def __init__(self, model: torch.nn.Module):
        self.owner = getattr(model, "model", model)
        self.calls = 0

    def __enter__(self) -> _TowerCalls:
        self.names = [
            n
            for n in ("get_image_features", "get_video_features", "get_audio_features")
            if hasattr(self.owner, n)
        ]
        for name in self.names:
            inner = getattr(self.owner, name)

            def counted(*args, inner=inner, **kwargs):
                self.calls += 1
                return inner(*args, **kwargs)

            setattr(self.owner, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.names:
            delattr(self.owner, name)


def _episode(setup, gen, first, tool_images, params, kind: str = "image") -> list[tuple]:
    """An agent's episode sent token in, as rollouts send it: each turn is the last turn's
    prompt, its generated tokens and a tool result with an image (or `kind` of media). Per
    turn: (tokens, logprobs, prompt tokens cached, prompt tokens)."""
    processor, x, turns = setup.processor, first, []
    for url in [*tool_images, None]:
        before = gen.stats()["num_prompt_tokens_cached"]
        (sample,) = run(gen.generate_all(x, params)).samples
        cached = gen.stats()["num_prompt_tokens_cached"] - before
        turns.append((sample.token_ids, sample.logprobs, cached, x.num_prompt_tokens))
        if url is not None:
            result = _tool_image(url, kind)
            media = setup.decoder.decode_many(processor.media_refs(result))
            x = processor.extend(x, sample.token_ids, processor.encode_continuation(result, media))
    return turns


@pytest.mark.parametrize("family", FAMILIES)
def test_with_the_cache_every_family_gives_the_tokens_and_logprobs_of_a_cold_prefill(
    setups, media, family, overlap, tmp_path
):
    """With the prefix cache, whatever the family's layers (Qwen3.5's and MiniCPM-V 4.6's
    linear attention, Gemma 4's sliding windows): (a) the same image prompt again resumes at
    its last full block, (b) n seeded samples of it, (c) a 3-turn episode whose tool returns an
    image resumes each turn where the last one ended; every token and logprob is the cold
    engine's (fp32, 1e-4). An image one pixel off misses the cache from its first token."""
    setup = setups(family)
    ask = "Describe it, please, in a few words."
    first = setup.encode(with_media("image", media["image"], ask))
    off_by_one = setup.encode(
        with_media("image", _one_pixel_off(Path(media["image"]), tmp_path / "b.png"), ask)
    )
    greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=True, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=6, logprobs=True)
    other = str(write_image(tmp_path / "other.png", 64, 48, seed=3))
    results = {}
    for cache in (False, True):
        gen = setup.generator(
            block_size=4,
            enable_prefix_caching=cache,
            prefix_state_rows=16,
            overlap_steps=overlap,
        )
        towers = _TowerCalls(setup.model)
        try:
            with towers:
                turns = _episode(setup, gen, first, [other, media["image"]], greedy)
                again = _cached_tokens(gen, first, greedy)
                samples = run(gen.generate_all(first, sampled)).samples
                missed = _cached_tokens(gen, off_by_one, greedy)
        finally:
            gen.shutdown()
        results[cache] = turns, again, samples, missed, towers.calls
    cold, warm = results[False], results[True]
    for (tokens, logprobs, _, _), (tokens_c, logprobs_c, _, _) in zip(
        cold[0], warm[0], strict=True
    ):
        assert tokens_c == tokens
        assert logprobs_c == pytest.approx(logprobs, abs=1e-4)
    n = first.num_prompt_tokens
    # Each later turn resumes where the turn before ended, after every token it fed (all but
    # its last): there exactly where layers keep states, else at the last full block.
    assert warm[0][0][2] == 0
    for before, turn in zip(warm[0], warm[0][1:], strict=False):
        fed = before[3] + 6 - 1
        assert fed // 4 * 4 <= turn[2] <= fed
    assert warm[1] == (cold[1][0], (n - 1) // 4 * 4)  # (a)
    for cold_sample, warm_sample in zip(cold[2], warm[2], strict=True):  # (b)
        assert warm_sample.token_ids == cold_sample.token_ids
        assert warm_sample.logprobs == pytest.approx(cold_sample.logprobs, abs=1e-4)
    (span,) = first.mm_spans
    assert warm[3][0] == cold[3][0]  # its own features, not the cached image's
    assert warm[3][1] <= span.start and cold[3][1] == 0
    # Media seen again (the image of each later turn and request) skipped the towers: a prompt
    # resuming past its media, or the encoder cache's answer.
    assert warm[4] < cold[4]


def test_gemma4_audio_prompts_and_turns_resume_from_the_cache_with_the_cold_tokens(
    setups, media, tmp_path
):
    """Gemma 4 with audio: the same audio prompt again, and an episode whose tool returns a
    clip, give the cold engine's tokens and logprobs while resuming from the cache."""
    setup = setups("gemma4")
    other = str(write_audio(tmp_path / "b.wav", seconds=1.0, seed=3))
    first = setup.encode(with_media("audio", media["audio"], "What do you hear?"))
    greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=True, ignore_eos=True)
    results = {}
    for cache in (False, True):
        gen = setup.generator(block_size=4, enable_prefix_caching=cache)
        try:
            turns = _episode(setup, gen, first, [other], greedy, kind="audio")
            again = _cached_tokens(gen, first, greedy)
        finally:
            gen.shutdown()
        results[cache] = turns, again
    (cold, cold_again), (warm, warm_again) = results[False], results[True]
    for a, b in zip(cold, warm, strict=True):
        assert b[0] == a[0] and b[1] == pytest.approx(a[1], abs=1e-4)
    assert warm[1][2] == warm[0][3] + 6 - 1  # the second turn resumed where the first ended
    assert warm_again == (cold_again[0], (first.num_prompt_tokens - 1) // 4 * 4)


def test_new_weights_forget_the_cached_blocks(setups):
    setup = setups("qwen3_vl")
    x = setup.encode(text("Once upon a time there was a river that ran to the sea."))
    gen = setup.generator(block_size=4, enable_prefix_caching=True)
    try:
        _cached_tokens(gen, x)
        assert gen.core.scheduler.kv.blocks.num_cached > 0
        weights = {name: p.detach().clone() for name, p in setup.model.named_parameters()}
        run(gen.update_weights(weights, 1))
        assert gen.core.scheduler.kv.blocks.num_cached == 0
        assert _cached_tokens(gen, x)[1] == 0
    finally:
        gen.shutdown()


def test_one_video_at_two_frame_rates_is_two_items_to_the_towers_and_the_blocks(setups, tmp_path):
    """A 10 s clip capped at 8 frames decodes other frames at 2 fps than at 1 fps, as many of
    them: two tower calls, no block shared past the ones before the video, and each answer the
    one transformers gives; the same rate again is answered from the cache."""
    setup = setups("qwen3_vl")
    clip = str(write_video(tmp_path / "long.mp4", seconds=10.0, fps=30.0))

    def asked(fps: float):
        part = {"type": "video_url", "video_url": {"url": clip, "fps": fps, "max_frames": 8}}
        text_part = {"type": "text", "text": "What happens?"}
        return setup.encode([{"role": "user", "content": [part, text_part]}])

    fast, slow = asked(2.0), asked(1.0)
    (span_fast,), (span_slow,) = fast.mm_spans, slow.mm_spans
    assert span_fast.num_placeholder_tokens == span_slow.num_placeholder_tokens
    assert span_fast.content_hash != span_slow.content_hash
    block = 4
    gen = setup.generator(block_size=block, enable_prefix_caching=True)
    try:
        fast_tokens, _ = _cached_tokens(gen, fast)
        slow_tokens, slow_cached = _cached_tokens(gen, slow)
        stats = gen.stats()
        again, again_cached = _cached_tokens(gen, fast)
    finally:
        gen.shutdown()
    assert (stats["num_media_encodes"], stats["num_media_encodes_cached"]) == (2, 0)
    assert slow_cached <= span_slow.start // block * block
    assert again_cached > span_fast.end and again == fast_tokens
    assert fast_tokens == setup.reference(fast, GREEDY.max_tokens)
    assert slow_tokens == setup.reference(slow, GREEDY.max_tokens)


def test_a_new_version_without_new_weights_keeps_the_cached_blocks(setups):
    """A GRPO step that took no optimizer step sends only its version: nothing changed, so the
    cached prefixes stay."""
    setup = setups("qwen3_vl")
    x = setup.encode(text("Once upon a time there was a river that ran to the sea."))
    gen = setup.generator(block_size=4, enable_prefix_caching=True)
    try:
        tokens, _ = _cached_tokens(gen, x)
        assert run(gen.update_weights([], 1)) == 0
        again, cached = _cached_tokens(gen, x)
        assert cached > 0 and again == tokens and gen.policy_version == 1
    finally:
        gen.shutdown()


def test_a_reset_prefix_cache_prefills_the_next_prompt_whole(setups):
    setup = setups("qwen3_vl")
    x = setup.encode(text("Once upon a time there was a river that ran to the sea."))
    gen = setup.generator(block_size=4, enable_prefix_caching=True)
    try:
        tokens, _ = _cached_tokens(gen, x)
        again, cached = _cached_tokens(gen, x)
        assert cached > 0 and again == tokens
        run(gen.reset_prefix_cache())
        assert gen.core.scheduler.kv.blocks.num_cached == 0
        assert _cached_tokens(gen, x) == (tokens, 0)
    finally:
        gen.shutdown()


def test_passes_over_the_same_media_share_one_tower_call_and_give_the_same_logprobs(setups, media):
    """What the trainer does with frozen towers (`Learner.features`): the policy's and the
    reference's passes over a trajectory, and the trajectories of a group, encode their media
    once; the logprobs are those of passes that encode it each time."""
    setup = setups("qwen3_5")
    x = setup.encode(with_media("image", media["image"], "Describe it, please."))
    reference = copy.deepcopy(setup.model)
    with torch.no_grad():
        cold = sequence_logprobs(setup.model, x, "cpu", start=1)
        features = EncoderCache(setup.model, 1 << 30)
        passes = []
        for _ in range(2):  # two trajectories of a group: policy and reference passes each
            with features.around(x.mm_spans), features.around(x.mm_spans, reference):
                passes += [
                    sequence_logprobs(m, x, "cpu", start=1) for m in (setup.model, reference)
                ]
    assert (features.num_misses, features.num_hits) == (1, 3)
    for logprobs in passes:
        torch.testing.assert_close(logprobs, cold, rtol=0, atol=1e-5)
    assert "get_image_features" not in vars(setup.model.model)  # unpatched after


def test_a_video_beside_an_image_is_cached_as_a_video(setups, media):
    """Qwen's `get_video_features` encodes its frames through `get_image_features`: that inner
    call belongs to the video's encoding, so it neither answers from the image's entry nor
    stores the video's features under the image's key."""
    setup = setups("qwen3_5")
    messages = with_media("image", media["image"], "Compare them.")
    messages[0]["content"].insert(1, {"type": "video_url", "video_url": {"url": media["video"]}})
    x = setup.encode(messages)
    assert [span.modality for span in x.mm_spans] == ["image", "video"]
    with torch.no_grad():
        cold = sequence_logprobs(setup.model, x, "cpu", start=1)
        features = EncoderCache(setup.model, 1 << 30)
        passes = []
        for _ in range(2):
            with features.around(x.mm_spans):
                passes.append(sequence_logprobs(setup.model, x, "cpu", start=1))
    assert (features.num_misses, features.num_hits) == (2, 2)
    for logprobs in passes:
        torch.testing.assert_close(logprobs, cold, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_saves_and_restores_beside_a_padded_graph_decode_keep_the_cold_tokens(
    setups, media, family, tmp_path
):
    """The decode step of CUDA graphs, run eagerly (`decode_graphs="static"`): its padded rows
    write idle slots' states, which saves run before and restores after; four episodes at once,
    token in, give the cold engine's tokens."""
    setup = setups(family)
    other = str(write_image(tmp_path / "other.png", 64, 48, seed=3))
    prompts = [
        setup.encode(with_media("image", media["image"], f"Describe it, please, part {i}."))
        for i in range(4)
    ]
    greedy = SamplingParams(temperature=0, max_tokens=5, logprobs=True, ignore_eos=True)

    async def episodes(gen):
        return await asyncio.gather(
            *(asyncio.to_thread(_episode, setup, gen, x, [other], greedy) for x in prompts)
        )

    results = {}
    for cache in (False, True):
        gen = setup.generator(
            block_size=4,
            enable_prefix_caching=cache,
            decode_graphs="static",
            overlap_steps="on",
        )
        try:
            results[cache] = run(episodes(gen))
        finally:
            gen.shutdown()
    for cold, warm in zip(results[False], results[True], strict=True):
        assert [t[0] for t in warm] == [t[0] for t in cold]
        assert warm[1][2] > 0  # the second turn resumed from the first's end


@pytest.mark.parametrize("image", [False, True], ids=["text", "image"])
@pytest.mark.parametrize("family", FAMILIES)
def test_turns_that_resume_together_share_forwards_and_keep_the_cold_tokens(
    setups, media, family, image, overlap
):
    """Four episodes take their turns together, as a GRPO group's do, each from a text question
    (with one image before it): every later turn resumes from the cache where the turn before
    ended, the resumptions of a step share forwards (`ModelRunner.prefill_parts`: the image in
    the cached prefix, Qwen's rope offset after it taken from the model's forward), and every
    token and logprob is the cold engine's (fp32, 1e-4). Qwen3.5 and MiniCPM-V 4.6 continue
    their linear-attention states per row, Gemma 4 its sliding rings; with an image, Qwen3.5's
    turns save their state at their last full block midway through the shared forwards."""
    setup = setups(family)

    def ask(question: str) -> list[dict]:
        return with_media("image", media["image"], question) if image else text(question)

    questions = [
        "Name three rivers.",
        "What is the capital of a small country, and why?",
        "Count backwards from ten.",
        "Say hello.",
    ]
    greedy = SamplingParams(temperature=0, max_tokens=5, logprobs=True, ignore_eos=True)
    results = {}
    for cache in (False, True):
        gen = setup.generator(block_size=4, enable_prefix_caching=cache, overlap_steps=overlap)
        runner = gen.core.executor.runner
        prefill_parts, shared = runner.prefill_parts, []

        def recording(parts, prefill_parts=prefill_parts, shared=shared):
            shared.append(len(parts))
            return prefill_parts(parts)

        runner.prefill_parts = recording
        try:
            prompts, turns = [setup.encode(ask(q)) for q in questions], []
            for turn in range(3):
                outputs = run(arrive_together(gen, prompts, greedy))
                samples = [o.samples[0] for o in outputs]
                turns.append([(s.token_ids, s.logprobs) for s in samples])
                reply = [{"role": "tool", "tool_call_id": "call_1", "content": f"Result {turn}."}]
                more = setup.processor.encode_continuation(reply, [])
                prompts = [
                    setup.processor.extend(x, s.token_ids, more)
                    for x, s in zip(prompts, samples, strict=True)
                ]
            cached = gen.stats()["num_prompt_tokens_cached"]
        finally:
            gen.shutdown()
        results[cache] = turns, cached, shared
    (cold, cold_cached, cold_shared), (warm, warm_cached, warm_shared) = results.values()
    for cold_turn, warm_turn in zip(cold, warm, strict=True):
        for (tokens, logprobs), (tokens_w, logprobs_w) in zip(cold_turn, warm_turn, strict=True):
            assert tokens_w == tokens
            assert logprobs_w == pytest.approx(logprobs, abs=1e-4)
    assert cold_cached == 0 and cold_shared == []
    assert warm_cached > 0
    assert max(warm_shared) == len(questions)  # a later turn's four resumptions, one forward


@pytest.mark.parametrize("prefill_compile", ["off", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_text_prompt_sent_again_resumes_from_the_cache_on_every_family(
    setups, family, prefill_compile
):
    """A text prompt's prefill saves the layer states (linear attention, sliding windows) at
    its last full block, so the same prompt again finds all of it but its last partial block
    cached, and answers as the cold engine does; also where prefills run compiled (the parts
    a save splits a prefill into, and the resumption, compiled at start-up, never after)."""
    setup = setups(family)
    x = setup.encode(text("Tell me a story about a river that ran to the sea, " * 6))
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=True, ignore_eos=True)
    cold = setup.generator(block_size=4, enable_prefix_caching=False)
    try:
        (expected,) = run(arrive_together(cold, [x], params))
    finally:
        cold.shutdown()
    gen = setup.generator(block_size=4, enable_prefix_caching=True, prefill_compile=prefill_compile)
    compiled_at_start = frames_compiled()
    try:
        first, _ = _cached_tokens(gen, x, params)
        again, cached = _cached_tokens(gen, x, params)
    finally:
        gen.shutdown()
    n = x.num_prompt_tokens
    assert cached >= 0.9 * n and cached == (n - 1) // 4 * 4, (cached, n)
    assert first == again == expected.samples[0].token_ids
    assert gen.core.executor.runner.parts_compiled == (prefill_compile != "off")
    assert frames_compiled() == compiled_at_start


# NOTE: "aot_eager", not "eager": AOTAutograd's decompositions guard on what Inductor's do
# (a slice that is or is not a view of all it gathered), which Dynamo's graph alone does not.
@pytest.mark.parametrize("prefill_compile", ["off", "aot_eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_questions_after_a_shared_system_prompt_resume_near_where_they_part(
    setups, family, prefill_compile
):
    """Four questions after one long system prompt, one at a time: the second resumes at the
    first's deepest checkpoint within the shared tokens (every `prefix_checkpoint_blocks`
    blocks below its last full block's save), and saves the state where it parts from the
    first; the third and fourth resume exactly there (>= 90% of their prompts). Every reply is
    the cache-off engine's, also where the cached engine's prefills run compiled (compiled at
    start-up, never after)."""
    setup = setups(family)
    system = "You are a careful assistant who answers about rivers and seas. " * 10
    questions = ["where does the river go?", "why is the sea salty?", "name a long river.",
                 "how deep is the ocean?"]  # fmt: skip
    prompts = [
        setup.encode([{"role": "system", "content": system}, *text(f"Question {i}: {q}")])
        for i, q in enumerate(questions, start=1)
    ]
    ids = [x.input_ids for x in prompts]
    # Where each question parts from the ones before it: the same token for all (its number).
    parts = {
        max(next(k for k, (a, b) in enumerate(zip(x, y, strict=False)) if a != b) for y in ids[:i])
        for i, x in enumerate(ids[1:], start=1)
    }
    (shared,) = parts
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=True, ignore_eos=True)
    replies = {}
    for cache in (False, True):
        gen = setup.generator(
            block_size=4,
            enable_prefix_caching=cache,
            prefix_checkpoint_blocks=8,
            prefill_compile=prefill_compile if cache else "off",
        )
        compiled_at_start = frames_compiled()
        try:
            replies[cache] = [_cached_tokens(gen, x, params) for x in prompts]
        finally:
            gen.shutdown()
    assert gen.core.executor.runner.parts_compiled == (prefill_compile != "off")
    assert frames_compiled() == compiled_at_start
    assert [tokens for tokens, _ in replies[True]] == [tokens for tokens, _ in replies[False]]
    cached = [count for _, count in replies[True]]
    assert cached[0] == 0 and shared >= 200, (cached, shared)
    # The first question's checkpoints: every 8 blocks of 4 up to 8 blocks below its last save.
    last = (prompts[0].num_prompt_tokens - 1) // 4 * 4
    assert cached[1] >= min(shared, last - 32) // 32 * 32, (cached, shared)
    for count, x in zip(cached[2:], prompts[2:], strict=True):
        assert count == shared // 4 * 4 and count >= 0.9 * x.num_prompt_tokens, (cached, shared)


def test_saved_states_count_their_hits_saves_and_evictions(setups):
    """Generator.stats() counts the saved states prompts resumed from, the saves and the least
    recently used ones evicted: a prompt twice is one hit (and no new save: its points are
    known); with two rows, more prompts' saves evict."""
    setup = setups("qwen3_5")
    prompts = [
        setup.encode(text(f"Tell me story number {i} about a long river. " * 4)) for i in range(3)
    ]
    gen = setup.generator(block_size=4, enable_prefix_caching=True, prefix_state_rows=2)
    try:
        counts = []
        for x in [prompts[0], prompts[0], prompts[1], prompts[2]]:
            _cached_tokens(gen, x)
            stats = gen.stats()
            counts.append(
                (stats["num_state_hits"], stats["num_state_saves"], stats["num_state_evictions"])
            )
    finally:
        gen.shutdown()
    (hits0, saves0, evicted0), (hits1, saves1, _), *_, (_, saves3, evicted3) = counts
    assert (hits0, evicted0) == (0, 0) and saves0 >= 1
    assert hits1 == 1 and saves1 == saves0  # its points are known already
    assert saves3 > saves1 and evicted3 > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_nine_prompts_through_three_slots_sent_twice_resume_the_second_time(setups, family):
    """The saved-state pool is sized in bytes (`prefix_state_memory_fraction`), not at two rows
    per running sequence: nine prompts through three slots, sent again, find their states
    kept, resume from their last full block, and answer as the cache-off engine does. (With six
    rows, each prompt's save had evicted the one the next prompt needed.)"""
    setup = setups(family)
    prompts = [
        setup.encode(text(f"Story {i}: tell me how the river number {i} ran to the sea. " * 6))
        for i in range(9)
    ]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    config = {"max_running_prompts": 3, "max_context_len": 4096}
    cold = setup.generator(enable_prefix_caching=False, **config)
    try:
        expected = [o.samples[0].token_ids for o in run(arrive_together(cold, prompts, params))]
    finally:
        cold.shutdown()
    gen = setup.generator(enable_prefix_caching=True, **config)
    try:
        first = run(arrive_together(gen, prompts, params))
        again = run(arrive_together(gen, prompts, params))
    finally:
        gen.shutdown()
    assert [o.samples[0].token_ids for o in first] == expected
    assert [o.samples[0].token_ids for o in again] == expected
    for x, output in zip(prompts, again, strict=True):
        n = x.num_prompt_tokens
        assert output.num_cached_tokens == (n - 1) // 16 * 16 >= 0.9 * n, (family, n)


def test_saved_state_rows_take_a_row_per_checkpoint_stretch_within_their_share():
    """`saved_state_rows`: a row for every `checkpoint_blocks` blocks the cache could hold,
    within the byte share, never fewer than two per running sequence; the share's refusal
    names the setting."""
    sizes = {"block_bytes": 8192, "row_bytes": 20480, "checkpoint_blocks": 16, "num_slots": 3}
    cache = 6 << 20  # 6 MiB: 41 stretches of 16 blocks and a row; the 0.1 share holds 30 rows
    assert saved_state_rows(cache, fraction=0.1, **sizes) == 30
    assert saved_state_rows(cache, fraction=0.5, **sizes) == cache // (16 * 8192 + 20480)
    assert saved_state_rows(cache, fraction=0.0, **sizes) == 6  # the floor
    assert saved_state_rows(1 << 20, fraction=0.1, **sizes) == 6
    with pytest.raises(ConfigError, match="prefix_state_memory_fraction") as refused:
        EngineConfig(prefix_state_memory_fraction=1.0)
    assert refused.value.param == "prefix_state_memory_fraction"


def test_a_groups_episodes_stage_their_one_prompt_once_and_keep_its_tokens(
    setups, media, monkeypatch
):
    """A GRPO group's episodes send one prompt object with an image: its resumptions from the
    prefix cache take the whole prompt's stack inputs (media encoded, tokens embedded) from the
    first staging instead of staging it again (`RecentStaged`), every token and logprob as when
    each episode sends a copy of its own; new weights make the next resumption stage it anew."""
    setup = setups("qwen3_5")
    prompt = setup.encode(with_media("image", media["image"], "Describe it in a few words."))
    calls = []
    real = model_runner.at_text_stack
    monkeypatch.setattr(
        model_runner, "at_text_stack", lambda *args: calls.append(args) or real(*args)
    )
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=True, ignore_eos=True)
    results = {}
    for shared in (False, True):
        gen = setup.generator(block_size=4, enable_prefix_caching=True)
        runner = gen.core.executor.runner
        try:
            prompts = [prompt] * 4 if shared else [copy.copy(prompt) for _ in range(4)]
            calls.clear()
            outputs = run(arrive_together(gen, prompts, params))
            samples = [(o.samples[0].token_ids, o.samples[0].logprobs) for o in outputs]
            results[shared] = samples, len(calls)
            if shared:
                runner.weights_changed(["model.language_model.embed_tokens.weight"])
                assert len(runner._recent_staged) == 0
                run(arrive_together(gen, [prompt], params))
                assert len(calls) == 2
        finally:
            gen.shutdown()
    (own, own_calls), (one, one_calls) = results[False], results[True]
    assert own_calls == 4 and one_calls == 1
    for (tokens, logprobs), (tokens_one, logprobs_one) in zip(own, one, strict=True):
        assert tokens_one == tokens
        assert logprobs_one == pytest.approx(logprobs, abs=1e-5)


def test_recent_staged_prompts_are_held_by_count_bytes_and_their_prompts_lives():
    """`RecentStaged` answers only for the very object it staged, drops an entry once no one
    holds its prompt, keeps at most `size` entries and `max_bytes` of tensors (the least
    recently used leaving first) and never keeps one larger than that."""

    class Prompt:  # any object a request holds (a PromptInputs)
        pass

    def staged(tokens: int) -> StagedPrompt:  # float32 embeddings of width 4 + int64 positions
        return StagedPrompt(
            {"inputs_embeds": torch.zeros(1, tokens, 4)},
            torch.zeros(1, tokens, dtype=torch.long),
            None,
        )

    assert staged(8).nbytes() == 8 * 4 * 4 + 8 * 8
    recent = RecentStaged(size=3, max_bytes=staged(8).nbytes() * 2 - 1)
    a, b, c = Prompt(), Prompt(), Prompt()
    recent.put(a, staged(4), 1)
    assert recent.get(a)[1] == 1 and recent.get(Prompt()) is None
    recent.put(b, staged(4), 2)
    recent.put(c, staged(8), 3)  # over the bytes: a, the least recently used, leaves
    assert recent.get(a) is None and recent.get(b)[1] == 2 and recent.get(c)[1] == 3
    recent.put(Prompt(), staged(64), 4)  # larger than all it may hold: not kept, nothing leaves
    assert len(recent) == 2
    del b
    gc.collect()
    recent.put(a, staged(1), 5)  # b's entry goes with b
    assert len(recent) == 2 and recent.get(a)[1] == 5
    recent.clear()
    assert len(recent) == 0 and recent.get(c) is None
    held = [Prompt() for _ in range(4)]
    for i, prompt in enumerate(held):
        recent.put(prompt, staged(1), i)
    assert len(recent) == 3 and recent.get(held[0]) is None and recent.get(held[3])[1] == 3


def test_a_resumption_shares_the_last_forward_of_a_prompt_that_stops_at_its_saves(
    setups, media, tmp_path
):
    """A prompt prefilled whole stops at each state save (a forward a round); a prompt arriving
    with it that resumes from the cache needs one part, which runs in the other's last round
    (`_prefill_parts`), so the step takes no forward more than the fresh prompt's rounds. Both
    answer with the cold engine's tokens and logprobs (fp32, 1e-4)."""
    setup = setups("qwen3_5")
    other = str(write_image(tmp_path / "other.png", 64, 48, seed=7))
    again = setup.encode(with_media("image", media["image"], "Describe it in a few words."))
    # a question whose prompt ends as far into its last block as the other's: the two tails
    # are of one width, so they may share a forward (prefill_groups)
    questions = ("Describe this one in a few words.", "Describe it.", "Describe it, please.",
                 "What is this?", "What is in this picture, please?")  # fmt: skip
    block = 4
    fresh = next(
        x
        for q in questions
        if (x := setup.encode(with_media("image", other, q))).num_prompt_tokens % block
        == again.num_prompt_tokens % block
    )
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=True, ignore_eos=True)
    answers = {}
    for cache in (False, True):
        gen = setup.generator(block_size=block, enable_prefix_caching=cache)
        runner = gen.core.executor.runner
        forwards, real = [], runner.prefill_parts
        runner.prefill_parts = lambda parts, real=real, forwards=forwards: (
            forwards.append([(p.slot, p.start, p.end) for p in parts]) or real(parts)
        )
        try:
            run(arrive_together(gen, [again], params))
            forwards.clear()
            outputs = run(arrive_together(gen, [again, fresh], params))
        finally:
            gen.shutdown()
        answers[cache] = [(o.samples[0].token_ids, o.samples[0].logprobs) for o in outputs]
    for (tokens, logprobs), (tokens_warm, logprobs_warm) in zip(*answers.values(), strict=True):
        assert tokens_warm == tokens
        assert logprobs_warm == pytest.approx(logprobs, abs=1e-4)
    assert len(forwards) >= 2, forwards  # the fresh prompt stops at a save at least once
    # the resumption (its one part) beside the fresh prompt's tail, in its last forward
    ends = sorted(x.num_prompt_tokens for x in (again, fresh))
    assert sorted(p[2] for p in forwards[-1]) == ends, forwards
    assert sum(len(parts) for parts in forwards) == len(forwards) + 1, forwards
