"""The paged KV cache end to end on tiny checkpoints of every family: a pool too small for the
running requests preempts the newest and resumes it from its tokens (media included), and every
request still gets transformers' greedy tokens; samples beyond the slots wait for one."""

from __future__ import annotations

import pytest
import torch

from areno.engine.kv.block_manager import blocks_for
from areno.engine.parallel.kv_pool import pool_gib
from areno.engine.sampling import SamplingParams
from areno.media.samples import write_image
from tests.engine.generating import (
    FAMILIES,
    GREEDY,
    arrive_together,
    frames_compiled,
    mixed_requests,
    run,
    run_chunked,
    text,
    with_media,
)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pool_too_small_preempts_and_resumes_with_the_same_tokens(setups, media, family, overlap):
    setup = setups(family)
    inputs = mixed_requests(setup, media)
    expected = [setup.reference(x, GREEDY.max_tokens) for x in inputs]
    longest = max(x.num_prompt_tokens for x in inputs)
    # Blocks of 4 tokens for the prompts of the first four (the slots) and two more (the
    # admission watermark is one): they are all admitted, and the first decodes to need more
    # blocks than that preempt the newest; the waiting ones (new or resumed) are admitted as
    # blocks free up, while the others decode.
    max_len = longest + GREEDY.max_tokens + 1
    prompts = sum(blocks_for(x.num_prompt_tokens, 4) for x in inputs[:4])
    num_blocks = max(blocks_for(max_len, 4), prompts + 2)
    gen = setup.generator(
        max_running_prompts=4,
        max_context_len=max_len,
        block_size=4,
        kv_cache_gib=pool_gib(setup.model, num_blocks, block_size=4),
        overlap_steps=overlap,
    )

    try:
        assert gen.stats()["num_blocks"] == num_blocks
        outputs = run(arrive_together(gen, inputs, GREEDY))  # admission fills the pool
        stats = gen.stats()
    finally:
        gen.shutdown()
    for i, (want, output) in enumerate(zip(expected, outputs, strict=True)):
        assert output.samples[0].token_ids == want, (i, output.samples[0].token_ids, want)
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == num_blocks and stats["num_running"] == 0


def test_samples_beyond_the_slots_run_later_and_equal_separate_requests(setups, overlap):
    setup = setups("qwen3_5")
    x = setup.encode(text("Tell me a story."))
    gen = setup.generator(max_running_prompts=2, overlap_steps=overlap)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=11, n=8, ignore_eos=True)
    try:
        together = run(gen.generate_all(x, params))
        apart = [
            run(gen.generate_all(x, SamplingParams(temperature=1.0, max_tokens=6, seed=11 + i)))
            for i in (0, 5, 7)
        ]
    finally:
        gen.shutdown()
    samples = sorted(together.samples, key=lambda s: s.index)
    assert [s.index for s in samples] == list(range(8))
    for i, one in zip((0, 5, 7), apart, strict=True):
        assert samples[i].token_ids == one.samples[0].token_ids


@pytest.mark.parametrize(
    ("overlap", "prefill_compile"),
    [("off", "off"), ("on", "off"), ("on", "eager")],
    ids=["steps", "overlapped", "overlapped-compiled"],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_long_text_prompts_prefilled_in_chunks_beside_decodes_equal_generate(
    setups, family, overlap, prefill_compile
):
    """A budget of 16 prompt tokens a step: the long prompts (past Gemma 4's 64-token sliding
    window) are prefilled in chunks over several steps while the short request decodes, and
    every request gets transformers' greedy tokens; also where prefills run compiled (the
    chunks' forwards compiled at start-up, never after)."""
    setup = setups(family)
    inputs = [
        setup.encode(text("Hi.")),
        setup.encode(text("Tell me everything about " + "the rivers and the hills " * 12)),
        setup.encode(text("List " + "numbers and letters, " * 20)),
    ]
    assert all(x.num_prompt_tokens > 64 for x in inputs[1:])
    expected = [setup.reference(x, GREEDY.max_tokens) for x in inputs]
    gen = setup.generator(
        max_num_batched_tokens=16, overlap_steps=overlap, prefill_compile=prefill_compile
    )
    compiled_at_start = frames_compiled()
    outputs, chunks = run_chunked(gen, inputs)
    for i, (want, output) in enumerate(zip(expected, outputs, strict=True)):
        assert output.samples[0].token_ids == want, (i, output.samples[0].token_ids, want)
    assert len(chunks) >= 8 and max(end - start for _, start, end in chunks) <= 16
    assert gen.core.executor.runner.parts_compiled == (prefill_compile != "off")
    assert frames_compiled() == compiled_at_start


@pytest.mark.parametrize("family", FAMILIES)
def test_media_prompts_prefilled_in_chunks_through_their_media_equal_generate(
    setups, media, family, overlap, tmp_path
):
    """A budget of 8 prompt tokens a step while a short request decodes: each media prompt is
    prefilled in chunks that cut through its media item (the tower runs once; each chunk takes
    its part of the features, Qwen's multimodal rope positions and Qwen3-VL's deepstack
    features with them), never inside a run the model attends to both ways (Gemma 4's image
    and frame tokens, held whole); every request gets transformers' greedy tokens."""
    setup = setups(family)
    tail = "Describe it for me, and " * 4
    media = media | {"image": str(write_image(tmp_path / "large.png", 160, 128))}
    kinds = ["image", "video"] + (
        ["audio"] if "audio" in setup.processor.adapter.modalities else []
    )
    inputs = [setup.encode(text("Hi."))] + [
        setup.encode(with_media(kind, media[kind], tail)) for kind in kinds
    ]
    expected = [setup.reference(x, GREEDY.max_tokens) for x in inputs]
    gen = setup.generator(
        max_num_batched_tokens=8,
        block_size=4,
        overlap_steps=overlap,
        enable_prefix_caching=False,  # every prompt from its first token
    )
    runner = gen.core.executor.runner
    runs = {x.num_prompt_tokens: runner.whole_runs(x) for x in inputs[1:]}
    outputs, chunks = run_chunked(gen, inputs)
    for i, (want, output) in enumerate(zip(expected, outputs, strict=True)):
        assert output.samples[0].token_ids == want, (i, output.samples[0].token_ids, want)
    assert (family == "gemma4") == any(runs.values())
    for x in inputs[1:]:
        mine = [(start, end) for n, start, end in chunks if n == x.num_prompt_tokens]
        assert mine[0][0] == 0 and mine[-1][1] == x.num_prompt_tokens
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:], strict=False))
        (span,) = x.mm_spans
        through_media = [c for c in mine if c[0] < span.end and span.start < c[1]]
        assert len(through_media) >= (4 if span.modality == "video" else 3), (span, mine)
        for start, end in runs[x.num_prompt_tokens]:
            assert not any(start < cut < end for _, cut in mine), (start, end, mine)


def test_gemma4_sliding_layers_keep_only_their_window_while_decoding_past_it(setups, overlap):
    setup = setups("gemma4")
    window = setup.model.config.get_text_config().sliding_window
    x = setup.encode(text("Once upon a time there was a river."))
    params = SamplingParams(temperature=0, max_tokens=window + 24, ignore_eos=True)
    with torch.no_grad():
        out = setup.model.generate(
            **x.model_inputs(),
            max_new_tokens=params.max_tokens,
            do_sample=False,
            eos_token_id=None,
            min_new_tokens=params.max_tokens,
        )
    expected = out[0, x.num_prompt_tokens :].tolist()
    assert x.num_prompt_tokens + len(expected) > window + 16  # well past the window
    gen = setup.generator(max_running_prompts=2, max_context_len=1024, overlap_steps=overlap)
    try:
        got = run(gen.generate_all(x, params)).samples[0].token_ids
        runner = gen.core.executor.runner
        cache, types = runner.cache, runner.cache.layer_types
    finally:
        gen.shutdown()
    assert got == expected
    ring = blocks_for(window, 16) + 1
    for i, layer in cache.attention.items():
        if types[i] == "sliding_attention":  # each slot's ring: the window and a block more
            # (the rows: 2 slots and the prefix cache's saved states)
            assert runner.num_rows == 2 + runner.num_state_rows
            assert layer.ring_blocks == ring and layer.keys.shape[0] == runner.num_rows * ring + 1
        else:  # the pool: every slot's 1,024 tokens
            assert layer.ring_blocks is None and layer.keys.shape[0] > 2 * 1024 // 16


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_a_padded_decode_step_keeps_the_state_of_a_prompt_between_its_chunks(setups, media, family):
    """The padded decode step (the CUDA graphs' step, run eagerly; compiled, its rows start at
    two) covers the slot of a video prompt between two of its chunks: that slot's
    linear-attention state (Qwen3.5) and sliding-window ring (Gemma 4) come through the step as
    its earlier chunks left them, and every request gets transformers' greedy tokens."""
    setup = setups(family)
    inputs = [
        setup.encode(text("Hi.")),
        setup.encode(with_media("video", media["video"], "Describe it for me, and " * 4)),
    ]
    expected = [setup.reference(x, GREEDY.max_tokens) for x in inputs]
    gen = setup.generator(
        max_num_batched_tokens=8,
        block_size=4,
        decode_graphs="static",
        decode_compile="eager",
        prefill_compile="off",
    )
    outputs, chunks = run_chunked(gen, inputs)
    assert [o.samples[0].token_ids for o in outputs] == expected
    assert len([c for c in chunks if c[0] == inputs[1].num_prompt_tokens]) >= 4


def test_the_pool_budget_reserves_what_runs_beside_the_pool(setups, media):
    """On a GPU the pool takes the engine's memory share less what else the engine uses: the
    media encoder cache at its size and the sampling side's per-sequence buffers over the
    vocabulary, which must cover the penalty history a penalised request allocates."""
    setup = setups("qwen3_5")
    gen = setup.generator(max_running_prompts=4, encoder_cache_gib=0.25)
    try:
        params = SamplingParams(max_tokens=3, presence_penalty=0.5, logprobs=True, top_logprobs=2)
        x = setup.encode(with_media("image", media["image"], "Describe."))
        run(arrive_together(gen, [x] * 4, params))
        worker = gen.core.executor.worker
        reserved = worker.reserved_bytes(activation=7, states=11)
        history = worker._history
    finally:
        gen.shutdown()
    assert reserved["prefill activations"] == 7 and reserved["running sequences' states"] == 11
    assert reserved["media encoder cache"] == 1 << 28
    kept = history.counts_SV.nbytes + history.in_prompt_SV.nbytes
    logits = 4 * worker.vocab_size * 4  # one float32 row of logits a running sequence
    assert kept > 0 and reserved["sampling buffers"] >= kept + 6 * logits
