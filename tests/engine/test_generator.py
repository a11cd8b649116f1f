"""The async Generator end to end on tiny checkpoints, against transformers: greedy equality for
staggered, mixed-media and unequal-length requests, logprobs, n > 1, queueing past the slots."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from areno.engine.sampling import SamplingParams
from tests.engine.generating import (
    FAMILIES,
    GREEDY,
    arrive_together,
    mixed_requests,
    run,
    text,
    with_media,
)


@pytest.mark.parametrize(
    "family, graphs, compile",
    [(f, "off", "off") for f in FAMILIES]
    + [("qwen3_5", "static", "off"), ("gemma4", "static", "off"), ("qwen3_5", "static", "eager")],
)
@pytest.mark.parametrize("overlap", ["off", "on"], ids=["steps", "overlapped"])
def test_staggered_greedy_equals_generate(setups, media, family, graphs, compile, overlap):
    setup = setups(family)
    inputs = mixed_requests(setup, media)
    expected = [setup.reference(x, GREEDY.max_tokens) for x in inputs]
    # Fewer slots than requests: some queue. "static" runs the CUDA-graph step eagerly; compile
    # "eager" traces that step with torch.compile (dynamo only, no kernel generation, on CPU).
    gen = setup.generator(
        max_running_prompts=3, decode_graphs=graphs, decode_compile=compile, overlap_steps=overlap
    )

    async def main():
        started = [asyncio.Event() for _ in inputs]

        async def one(i, x):
            if i:
                await started[i - 1].wait()  # arrive while the previous one is decoding
            tokens = []
            async for output in gen.generate(x, GREEDY):
                tokens += output.samples[0].token_ids
                if len(tokens) >= 2:
                    started[i].set()
            started[i].set()
            return tokens

        return await asyncio.gather(*(one(i, x) for i, x in enumerate(inputs)))

    try:
        got = run(main())
    finally:
        gen.shutdown()
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have == want, (i, have, want)
    assert gen.core.overlap is (overlap == "on")
    if compile != "off":  # the compiled step ran: it never fell back to the uncompiled one
        assert gen.core.executor.runner.graphs.compiled


def test_a_compiled_decode_compiles_only_while_the_engine_starts(setups):
    # Before, the first compile pinned its row count (2 rows = the tiny model's 2 KV heads,
    # through duck sizing) and the first request that decoded more rows recompiled the step in
    # its own time.
    from torch._dynamo.utils import counters

    setup = setups("qwen3_5")
    gen = setup.generator(max_running_prompts=4, decode_graphs="static", decode_compile="eager")
    compiled_at_start = counters["frames"]["ok"]
    prompts = [setup.encode(text("Hi.")), *(setup.encode(text("Say " * n)) for n in (3, 20, 90))]

    async def main():
        await gen.generate_all(prompts[0], GREEDY)  # one row: the smallest bucket
        await asyncio.gather(*(gen.generate_all(x, GREEDY) for x in prompts[1:]))  # three rows

    try:
        run(main())
    finally:
        gen.shutdown()
    assert compiled_at_start > 0
    assert counters["frames"]["ok"] == compiled_at_start


def started_and_generated(setup, generate, **config) -> tuple[int, int, list]:
    """An engine of `config` (compiled, static decode graphs, small blocks): the graphs its
    start-up compiled, the frames compiled after it, and what `generate(engine)` returns."""
    from torch._dynamo.utils import counters

    config = dict(
        max_running_prompts=4, decode_graphs="static", decode_compile="eager",
        prefill_compile="eager", max_num_batched_tokens=96, block_size=4,
    ) | config  # fmt: skip
    before = counters["stats"]["unique_graphs"]
    gen = setup.generator(**config)
    started = counters["stats"]["unique_graphs"] - before
    at_start = counters["frames"]["ok"]
    try:
        out = run(generate(gen))
    finally:
        gen.shutdown()
    return started, counters["frames"]["ok"] - at_start, out


def test_lone_prompts_beside_a_copy_start_up_with_fewer_graphs_and_generate_the_same(setups):
    """With lone prompts padded (`pad_lone_prefills`, on by default on CUDA) the start-up
    compiles no prefill graph of a batch of one, and no request compiles after it: a lone
    prompt, two together, a lone resumption from the prefix cache, and a lone prompt past the
    padded length (uncompiled). The tokens are the unpadded engine's."""
    setup = setups("qwen3_5")
    base = [setup.encode(text("Say " * n)) for n in (3, 20)]
    prompts = [*base, base[1].with_tokens(base[1].input_ids + [7, 8, 9, 10, 11])]
    longer = setup.encode(text("Say " * 60))

    async def main(gen):
        alone = await gen.generate_all(prompts[0], GREEDY)
        together = await asyncio.gather(*(gen.generate_all(x, GREEDY) for x in prompts[:2]))
        resumed = await gen.generate_all(prompts[2], GREEDY)  # from prompts[1]'s blocks
        long = await gen.generate_all(longer, GREEDY)  # 60+ tokens: past 96 // 2
        return [o.samples[0].token_ids for o in (alone, *together, resumed, long)]

    off = started_and_generated(setup, main, pad_lone_prefills="off")
    on = started_and_generated(setup, main, pad_lone_prefills="on")
    assert off[1] == on[1] == 0  # nothing compiled after the start-up
    assert on[2] == off[2]
    # The batched prefill and the prefill of parts each lose their graph of a batch of one.
    assert on[0] == off[0] - 2


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_whole_prompts_as_parts_start_up_with_one_prefill_graph_and_generate_the_same(
    setups, family, monkeypatch
):
    """With whole prompts prefilled as parts (`whole_prompts_as_parts`, on by default on CUDA,
    with lone prompts padded as there) the start-up compiles no batched prefill graph, no
    request runs one or compiles after the start-up (a lone prompt, two of unequal lengths
    together, three samples of one), and the tokens are the batched prefill's. No prefix
    cache: with one, a linear-attention model's whole prompts save states midway and so run as
    parts either way."""
    from areno.engine.runner.model_runner import ModelRunner

    batched = []
    prefill_batch = ModelRunner.prefill_batch

    def counted(runner, prompts, *args, **kwargs):
        batched.append(len(prompts))
        return prefill_batch(runner, prompts, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "prefill_batch", counted)
    setup = setups(family)
    base = [setup.encode(text("Say " * n)) for n in (3, 20)]
    three = SamplingParams(temperature=0, max_tokens=6, n=3)

    async def main(gen):
        paths = gen.core.executor.compiled_paths()
        batched.clear()
        alone = await gen.generate_all(base[0], GREEDY)
        together = await asyncio.gather(*(gen.generate_all(x, GREEDY) for x in base))
        samples = await gen.generate_all(base[1], three)
        outs = [o.samples[0].token_ids for o in (alone, *together)]
        return paths, list(batched), outs + [s.token_ids for s in samples.samples]

    runs = {
        mode: started_and_generated(
            setup,
            main,
            pad_lone_prefills="on",
            whole_prompts_as_parts=mode,
            enable_prefix_caching=False,
        )
        for mode in ("off", "on")
    }
    (off_graphs, _, (off_paths, off_batched, off_tokens)) = runs["off"]
    (on_graphs, on_compiled, (on_paths, on_batched, on_tokens)) = runs["on"]
    assert off_paths.batched_prefill and not on_paths.batched_prefill and on_paths.prefill_parts
    assert off_batched and not on_batched
    # (With the batched graph, Gemma's first request compiles it again: its sliding mask's
    # batch stride is not the start-up prompts' one, a guard TORCH_LOGS=recompiles names.)
    assert on_compiled == 0
    assert on_tokens == off_tokens
    # The batched prefill's graph (of two rows: lone prompts run beside a copy) is not compiled.
    assert on_graphs == off_graphs - 1


def test_logprobs_match_a_full_forward_and_score(setups, overlap, media):
    setup = setups("gemma4")
    x = setup.encode(with_media("image", media["image"], "Describe."))
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    gen = setup.generator(overlap_steps=overlap)
    try:
        output = run(gen.generate_all(x, params))
        sample = output.samples[0]
        full = x.with_tokens(x.input_ids + sample.token_ids)
        scored = run(gen.score(full, num_top_logprobs=3))
    finally:
        gen.shutdown()
    with torch.no_grad():
        logits = setup.model(**full.model_inputs()).logits[0].float()
    every_NV = torch.log_softmax(logits, -1)[:-1]
    ref_all = every_NV[x.num_prompt_tokens - 1 :]
    ref = ref_all.gather(-1, torch.tensor(sample.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(sample.logprobs), ref, atol=1e-4)
    assert torch.allclose(torch.tensor(scored.logprobs[x.num_prompt_tokens - 1 :]), ref, atol=1e-4)
    # score's alternatives: at every position, prompt tokens included
    want_lps, want_ids = every_NV.topk(3)
    assert [[t for t, _ in top] for top in scored.top_logprobs] == want_ids.tolist()
    got_lps = torch.tensor([[lp for _, lp in top] for top in scored.top_logprobs])
    assert torch.allclose(got_lps, want_lps, atol=1e-4)
    for step, top in enumerate(sample.top_logprobs):
        ids, lps = zip(*top, strict=True)
        want_lps, want_ids = ref_all[step].topk(3)
        assert list(ids) == want_ids.tolist()
        assert torch.allclose(torch.tensor(lps), want_lps, atol=1e-4)


def test_n_samples_share_a_prefill_and_match_separate_seeded_requests(setups, overlap, media):
    setup = setups("qwen3_5")
    x = setup.encode(with_media("image", media["image"], "Describe."))
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=7, n=3, ignore_eos=True)
    # NOTE: without the prefix cache, which would split this prompt where it saves the state
    # and serve the later requests from it (test_prefix_cache.py covers n samples with it).
    gen = setup.generator(overlap_steps=overlap, enable_prefix_caching=False)
    prefills = []
    runner = gen.core.executor.runner
    original = runner.prefill
    runner.prefill = lambda inputs, slots, tables: (
        prefills.append(slots) or original(inputs, slots, tables)
    )
    try:
        together = run(gen.generate_all(x, params))
        apart = [
            run(gen.generate_all(x, SamplingParams(temperature=1.0, max_tokens=8, seed=7 + i)))
            for i in range(3)
        ]
    finally:
        gen.shutdown()
    assert len(prefills[0]) == 3  # one prefill forked into three slots
    assert [s.index for s in together.samples] == [0, 1, 2]
    for i in range(3):
        assert together.samples[i].token_ids == apart[i].samples[0].token_ids
    assert len({tuple(s.token_ids) for s in together.samples}) > 1


@pytest.mark.parametrize("prefill_compile", ["off", "eager"])
@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_text_prompts_of_unequal_lengths_arriving_together_equal_generate(
    setups, family, overlap, prefill_compile
):
    """Prompts admitted in one step share a padded prefill (`runner/prefills.py::prefill_groups`); each gives
    what transformers' generate gives it alone, also when that prefill runs compiled (dynamo's
    trace, as inductor gets it; compiled during the engine's warm-up). Prefix caching off:
    with it on an engine saves a text prompt's states midway, and such prompts share a
    forward of parts instead (test_prefix_cache.py)."""
    setup = setups(family)
    inputs = [
        setup.encode(text(t))
        for t in ("Name a color.", "Name a color you like.", "Name a color you like a lot.")
    ]
    assert len({x.num_prompt_tokens for x in inputs}) == 3
    expected = [setup.reference(x, GREEDY.max_tokens) for x in inputs]
    gen = setup.generator(
        overlap_steps=overlap, prefill_compile=prefill_compile, enable_prefix_caching=False
    )
    runner = gen.core.executor.runner
    batched: list[list[int]] = []
    prefill_batch = runner.prefill_batch

    def recording(prompts, slots, tables):
        batched.append([p.num_prompt_tokens for p in prompts])
        return prefill_batch(prompts, slots, tables)

    runner.prefill_batch = recording

    try:
        outputs = run(arrive_together(gen, inputs, GREEDY))  # all three start in one step
    finally:
        gen.shutdown()
    assert batched == [sorted(x.num_prompt_tokens for x in inputs)]  # one padded forward
    assert [out.samples[0].token_ids for out in outputs] == expected
    assert runner.prefill_compiled == (prefill_compile != "off")  # no fallback


@pytest.mark.parametrize("prefill_compile", ["off", "eager"])
def test_a_lone_text_prompt_runs_the_compiled_batched_prefill_where_there_is_one(
    setups, prefill_compile
):
    """A prompt alone in its step takes the compiled text stack where prefills are compiled
    (eager, its launches cost the host more than the GPU's work); uncompiled, the model's own
    forward. Either way it gives what transformers' generate gives. Prefix caching off (with
    it on, the prompt's state saves split it into parts, test_prefix_cache.py)."""
    setup = setups("qwen3_5")
    x = setup.encode(text("Name a color you like a lot."))
    gen = setup.generator(prefill_compile=prefill_compile, enable_prefix_caching=False)
    runner = gen.core.executor.runner
    batched: list[int] = []
    prefill_batch = runner.prefill_batch

    def recording(prompts, slots, tables):
        batched.append(len(prompts))
        return prefill_batch(prompts, slots, tables)

    runner.prefill_batch = recording
    try:
        (output,) = run(arrive_together(gen, [x], GREEDY))
    finally:
        gen.shutdown()
    assert batched == ([1] if prefill_compile != "off" else [])
    assert output.samples[0].token_ids == setup.reference(x, GREEDY.max_tokens)


def test_more_requests_than_slots_queue_and_all_finish(setups, overlap):
    setup = setups("qwen3_5")
    inputs = [setup.encode(text(f"Request number {i}.")) for i in range(6)]
    gen = setup.generator(overlap_steps=overlap, max_running_prompts=2)

    async def main():
        start = time.perf_counter()
        outputs = await arrive_together(gen, inputs, GREEDY)
        return outputs, time.perf_counter() - start

    try:
        outputs, wall = run(main())
    finally:
        gen.shutdown()
    for x, output in zip(inputs, outputs, strict=True):
        assert output.finished
        assert output.samples[0].token_ids == setup.reference(x, GREEDY.max_tokens)
    # Each request's engine timings: queued, prefilled, decoded, within the wall time; the two
    # admitted first never waited for a slot, the last two waited for two requests to finish.
    timings = [output.timings for output in outputs]
    for t in timings:
        assert t.prefill_s > 0 and t.decode_s > 0
        assert t.queue_s + t.prefill_s + t.decode_s <= wall
    first = max(t.queue_s for t in timings[:2])
    assert min(t.queue_s for t in timings[4:]) > first + min(t.decode_s for t in timings[:2])


@pytest.mark.parametrize("graphs", ["off", "static"])
def test_a_bf16_linear_state_keeps_greedy_parity(setups, media, graphs):
    """`linear_state_dtype="bfloat16"` stores the gated-delta-net states in bf16 (computed in
    fp32): on the tiny Qwen3.5, staggered mixed requests still decode transformers' greedy
    tokens (its fp32 states)."""
    setup = setups("qwen3_5")
    inputs = mixed_requests(setup, media)
    expected = [setup.reference(x, GREEDY.max_tokens) for x in inputs]
    gen = setup.generator(
        max_running_prompts=3, decode_graphs=graphs, linear_state_dtype="bfloat16"
    )

    async def one(x):
        tokens = []
        async for output in gen.generate(x, GREEDY):
            tokens += output.samples[0].token_ids
        return tokens

    async def main():
        return await asyncio.gather(*(one(x) for x in inputs))

    try:
        got = run(main())
        states = gen.core.executor.runner.cache.linear.values()
        assert {state.recurrent.dtype for state in states} == {torch.bfloat16}
    finally:
        gen.shutdown()
    assert got == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_a_request_read_at_its_end_gets_the_streamed_text_from_one_decode(setups, family):
    """`generate_all` (no stop strings) keeps the tokens and decodes them once at the end;
    `generate` streams the text token by token. Same seeds, same tokens, same text, for two
    samples of random tokens (byte-fallback runs and special tokens among them)."""
    setup = setups(family)
    x = setup.encode(text("Say something long."))
    params = SamplingParams(temperature=1.0, max_tokens=24, n=2, seed=3, ignore_eos=True)
    gen = setup.generator()

    async def main():
        streamed = ["", ""]
        tokens: list[list[int]] = [[], []]
        async for output in gen.generate(x, params):
            for sample in output.samples:
                streamed[sample.index] += sample.text
                tokens[sample.index] += sample.token_ids
        merged = await gen.generate_all(x, params)
        return streamed, tokens, merged

    try:
        streamed, tokens, merged = run(main())
    finally:
        gen.shutdown()
    by_index = {sample.index: sample for sample in merged.samples}
    for i in range(2):
        assert by_index[i].token_ids == tokens[i]
        assert by_index[i].text == streamed[i] and streamed[i]
