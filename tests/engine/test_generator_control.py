"""The async Generator's controls on tiny checkpoints: stop strings, limits, cancellation, the
whole-request hand-over, garbage-collection freezing, pause / resume, weight updates and start-up
prompts."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from areno.engine import gc_freeze
from areno.engine import generator as generator_module
from areno.engine.config import EngineConfig, resolve_overlap
from areno.engine.core.scheduler import SequenceTooLongError
from areno.engine.generator import Generator
from areno.engine.outputs import AbortCause, merge_outputs
from areno.engine.parallel.worker import WeightUpdateError
from areno.engine.sampling import SamplingParams
from areno.errors import ConfigError
from tests.engine.generating import (
    GREEDY,
    Setup,
    collect,
    mixed_requests,
    run,
    text,
)


def test_stop_strings_end_the_text_and_never_leak_into_the_stream(setups, overlap):
    setup = setups("qwen3_5")
    x = setup.encode(text("Tell me a story about a cat."))
    gen = setup.generator(overlap_steps=overlap)
    try:
        base = run(gen.generate_all(x, SamplingParams(temperature=0, max_tokens=24)))
        full_text = base.samples[0].text
        words = full_text.split()
        assert len(words) >= 3, full_text
        stop = words[len(words) // 2]
        cut = full_text.index(stop)
        stream = run(
            collect(gen.generate(x, SamplingParams(temperature=0, max_tokens=24, stop=[stop])))
        )
        kept = run(
            gen.generate_all(
                x,
                SamplingParams(
                    temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True
                ),
            )
        )
    finally:
        gen.shutdown()
    _, stream_text, deltas = stream
    assert stream_text == full_text[:cut]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    assert kept.samples[0].text == full_text[: cut + len(stop)]


def test_max_tokens_and_context_limit(setups, overlap):
    setup = setups("qwen3_5")
    x = setup.encode(text("Count with me."))
    gen = setup.generator(overlap_steps=overlap, max_context_len=x.num_prompt_tokens + 5)
    try:
        short = run(gen.generate_all(x, SamplingParams(max_tokens=3, ignore_eos=True, seed=1)))
        capped = run(gen.generate_all(x, SamplingParams(max_tokens=50, ignore_eos=True, seed=1)))
        with pytest.raises(SequenceTooLongError, match="max_context_len"):
            run(gen.generate_all(setup.encode(text("word " * 40)), GREEDY))
        # More samples than the 4 slots: they run as slots free up, never refused.
        many = run(gen.generate_all(x, SamplingParams(n=6, max_tokens=3, seed=2)))
    finally:
        gen.shutdown()
    assert sorted(s.index for s in many.samples) == list(range(6))
    assert all(len(s.token_ids) == 3 for s in many.samples)
    assert len(short.samples[0].token_ids) == 3 and short.samples[0].finish_reason == "length"
    assert len(capped.samples[0].token_ids) == 5 and capped.samples[0].finish_reason == "length"


def test_leaving_a_stream_cancels_it_and_frees_its_slots(setups, overlap):
    setup = setups("qwen3_5")
    x = setup.encode(text("Go on forever."))
    gen = setup.generator(overlap_steps=overlap, max_running_prompts=2)
    long = SamplingParams(max_tokens=500, ignore_eos=True, n=2, seed=0)

    async def main():
        stream = gen.generate(x, long)
        async for output in stream:
            if output.samples[0].token_ids:
                break
        await stream.aclose()
        for _ in range(200):
            if gen.stats()["num_free_slots"] == 2:
                break
            await asyncio.sleep(0.01)
        stats_after_cancel = gen.stats()
        # The freed slots serve the next request; abort() ends a stream with "abort".
        task = asyncio.create_task(collect(gen.generate(x, long, request_id="r2")))
        while gen.stats()["num_running"] == 0:
            await asyncio.sleep(0.01)
        await gen.abort("r2")
        return stats_after_cancel, await task

    try:
        stats, (_, _, deltas) = run(main())
    finally:
        gen.shutdown()
    assert stats["num_free_slots"] == 2 and stats["num_running"] == 0
    assert {d.finish_reason for d in deltas if d.finish_reason} == {"abort"}
    assert {d.abort_cause for d in deltas if d.finish_reason} == {AbortCause.CALLER}


def test_a_request_cancelled_before_the_engine_adds_it_leaves_the_engine_serving(setups):
    """A caller cancelled while its request waits for the engine thread (a client gone, or a
    batch's sibling request refused): the request is added, then aborted, and nothing of it
    stays; the engine thread lives on."""
    import threading

    setup = setups("qwen3_5")
    x = setup.encode(text("Hello."))
    gen = setup.generator()
    entered, busy = threading.Event(), threading.Event()

    def hold() -> None:  # the engine thread is busy here: the next commands wait
        entered.set()
        busy.wait()

    async def main():
        held = gen._submit(hold)
        while not entered.is_set():
            await asyncio.sleep(0.001)
        task = asyncio.create_task(gen.generate_all(x, GREEDY, request_id="gone"))
        while not gen._commands:
            await asyncio.sleep(0.001)
        [(_, waited)] = gen._commands
        assert waited is None  # posted: the caller never waits for its request to be added
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        busy.set()
        held.result(timeout=10)
        # A dead engine thread would leave this waiting forever.
        output = await asyncio.wait_for(gen.generate_all(x, GREEDY), timeout=60)
        assert "gone" not in gen.core.scheduler.request_ids()
        return output

    try:
        output = run(main())
        gen.check_health()
    finally:
        busy.set()
        gen.shutdown()
    assert output.finished and output.samples[0].token_ids
    assert gen.core.scheduler.find("gone") is None


def test_a_whole_request_is_handed_over_once_and_equals_its_stream(setups, overlap):
    """generate_all's deltas wait in the engine thread until the request ends: its caller's loop
    gets one hand-over, not one per step. Cancelling it frees the slots and what was kept."""
    setup = setups("qwen3_5")
    x = setup.encode(text("Count slowly."))
    gen = setup.generator(overlap_steps=overlap, max_running_prompts=2)
    params = SamplingParams(max_tokens=12, ignore_eos=True, n=2, seed=3, logprobs=True)
    long = SamplingParams(max_tokens=500, ignore_eos=True)

    async def main():
        streamed = [out async for out in gen.generate(x, params)]
        handed_over = []
        put_all = generator_module._put_all

        def counting(batch):
            handed_over.extend(item for _, item in batch)
            put_all(batch)

        generator_module._put_all = counting
        try:
            whole = await gen.generate_all(x, params, request_id="whole")
        finally:
            generator_module._put_all = put_all
        task = asyncio.create_task(gen.generate_all(x, long, request_id="left"))
        while not gen._collected.get("left"):
            await asyncio.sleep(0.01)
        task.cancel()
        for _ in range(200):
            if gen.stats()["num_free_slots"] == 2 and not gen._collected:
                break
            await asyncio.sleep(0.01)
        return streamed, whole, handed_over, gen.stats()

    try:
        streamed, whole, handed_over, stats = run(main())
    finally:
        gen.shutdown()
    assert len(handed_over) == 1 and isinstance(handed_over[0], list)
    assert len(handed_over[0]) >= 12  # every step's delta, in one hand-over
    assert whole.samples == merge_outputs(streamed).samples and whole.finished
    assert stats["num_free_slots"] == 2 and not gen._collected


def test_a_stream_hands_over_its_tokens_at_most_every_stream_interval(setups, overlap):
    """A streamed request's first token is handed over alone and at once; later steps' tokens
    wait in the engine thread for the stream interval and go over together at its end (a
    caller reads hand-overs that meet in its queue as one delta, each token keeping its policy
    version). Interval 0 hands over every step's. The stream holds every token either way."""
    setup = setups("qwen3_5")
    x = setup.encode(text("Count slowly."))
    params = SamplingParams(max_tokens=12, ignore_eos=True, n=2, seed=3, logprobs=True)
    streams, handed = {}, {}
    put_all = generator_module._put_all
    for interval in (0.0, 60_000.0):
        gen = setup.generator(overlap_steps=overlap, stream_interval_ms=interval)
        handed[interval] = []

        def counting(batch, into=handed[interval]):
            into.extend(item for _, item in batch)
            put_all(batch)

        generator_module._put_all = counting
        try:
            streams[interval] = run(collect_outputs(gen.generate(x, params)))
        finally:
            generator_module._put_all = put_all
            gen.shutdown()
    assert [len(item) for item in handed[0.0]] == [1] * 12
    first, rest = handed[60_000.0]
    assert [len(d.token_ids) for d in first[0].samples] == [1, 1] and len(first) == 1
    assert len(rest) == 11 and rest[-1].finished
    merged = merge_outputs(streams[60_000.0]).samples
    assert merged == merge_outputs(streams[0.0]).samples
    assert all(d.policy_versions == [0] * 12 for d in merged)
    assert all(len(d.logprobs) == 12 and d.finish_reason == "length" for d in merged)


async def collect_outputs(stream) -> list:
    return [output async for output in stream]


def test_a_stream_interval_or_checkpoint_spacing_below_zero_is_refused() -> None:
    with pytest.raises(ConfigError, match="stream_interval_ms") as raised:
        EngineConfig(stream_interval_ms=-1)
    assert raised.value.param == "stream_interval_ms"
    with pytest.raises(ConfigError, match="prefix_checkpoint_blocks must be an integer >= 0"):
        EngineConfig(prefix_checkpoint_blocks=-1)
    with pytest.raises(ConfigError, match="prefix_checkpoint_blocks"):
        EngineConfig(prefix_checkpoint_blocks=2.5)


def test_overlapped_steps_are_on_for_one_cuda_process_and_refused_for_a_tp_group() -> None:
    with pytest.raises(ConfigError, match="overlap_steps needs tp_size 1"):
        EngineConfig(tp_size=2, overlap_steps="on")
    with pytest.raises(ConfigError, match=r"overlap_steps must be one of .*; got 'yes'"):
        EngineConfig(overlap_steps="yes")
    # A Ray Serve config's bare `on` / `off` arrives as a YAML boolean.
    assert EngineConfig(overlap_steps=True).overlap_steps == "on"
    assert EngineConfig(overlap_steps=False).overlap_steps == "off"
    assert resolve_overlap(EngineConfig(), "cuda")
    assert not resolve_overlap(EngineConfig(), "cpu")
    assert not resolve_overlap(EngineConfig(tp_size=2), "cuda")
    assert resolve_overlap(EngineConfig(overlap_steps="on"), "cpu")
    assert not resolve_overlap(EngineConfig(overlap_steps="off"), "cuda")


def test_the_engine_freezes_what_lives_at_start_out_of_garbage_collection(setups):
    """A full collection walks every tracked object, and a compiled step leaves millions: the
    engine freezes what lives once it has started (a step stalled ~0.5 s on the H200 without);
    the last engine of the process to shut down unfreezes, so later garbage is collected."""
    assert gc_freeze.live_engines() == 0, "an earlier test left an engine running"
    setup = setups("qwen3_5")
    first = setup.generator()
    try:
        frozen = gc.get_freeze_count()
        second = setup.generator()
        try:
            assert gc.get_freeze_count() >= frozen
            out = run(second.generate_all(setup.encode(text("Still serving.")), GREEDY))
        finally:
            second.shutdown()
        second.shutdown()  # a second shutdown releases nothing more
        assert gc.get_freeze_count() >= frozen  # the first engine is still running
    finally:
        first.shutdown()
    assert frozen > 10_000  # the model, tokenizer and engine, at least
    assert out.finished and gc.get_freeze_count() == 0


def test_pause_keep_holds_requests_and_resume_finishes_them(setups, overlap):
    setup = setups("qwen3_5")
    x = setup.encode(text("Pause me."))
    gen = setup.generator(overlap_steps=overlap)
    params = SamplingParams(max_tokens=40, ignore_eos=True, seed=3)

    async def main():
        counts = []
        task = asyncio.create_task(gen.generate_all(x, params))
        while gen.stats()["num_running"] == 0:
            await asyncio.sleep(0.005)
        await gen.pause("keep")
        running = gen.stats()["num_running"]
        await asyncio.sleep(0.2)
        counts.append(gen.stats()["num_running"])
        assert not task.done()
        # A request arriving while paused waits for resume.
        late = asyncio.create_task(gen.generate_all(x, GREEDY))
        await asyncio.sleep(0.1)
        assert not late.done()
        await gen.resume()
        return running, counts, await task, await late

    try:
        running, counts, output, late = run(main())
    finally:
        gen.shutdown()
    assert running == 1 and counts == [1]
    assert len(output.samples[0].token_ids) == 40
    assert late.finished


def test_pause_drain_waits_for_running_requests(setups, overlap):
    setup = setups("qwen3_5")
    x = setup.encode(text("Drain me."))
    gen = setup.generator(overlap_steps=overlap)

    async def main():
        task = asyncio.create_task(
            gen.generate_all(x, SamplingParams(max_tokens=20, ignore_eos=True))
        )
        while gen.stats()["num_running"] == 0:
            await asyncio.sleep(0.005)
        await gen.pause("drain")
        done_at_pause = task.done()
        await gen.resume()
        return done_at_pause, await task

    try:
        done_at_pause, output = run(main())
    finally:
        gen.shutdown()
    assert done_at_pause and len(output.samples[0].token_ids) == 20


def test_pause_abort_cuts_requests_off_with_their_cause_and_resume_serves_again(setups, overlap):
    """pause("abort") ends a stream and a whole request in flight with finish_reason "abort"
    and cause PAUSE (the tokens sampled so far kept); after resume a request runs to the end.
    A shutdown ends what is left with cause SHUTDOWN."""
    setup = setups("qwen3_5")
    x = setup.encode(text("Cut me off."))
    gen = setup.generator(overlap_steps=overlap)
    long = SamplingParams(max_tokens=900, ignore_eos=True, seed=3)

    async def main():
        deltas = []

        async def read() -> None:
            async for output in gen.generate(x, long):
                deltas.extend(output.samples)

        whole = asyncio.create_task(gen.generate_all(x, long))
        stream = asyncio.create_task(read())
        while len(deltas) < 2:  # both requests decode (they were admitted together)
            await asyncio.sleep(0.005)
        await gen.pause("abort")
        await stream
        cut = (None, None, deltas), await whole
        stats = gen.stats()
        await gen.resume()
        after = await gen.generate_all(x, SamplingParams(max_tokens=5, ignore_eos=True))
        left = asyncio.create_task(collect(gen.generate(x, long)))
        while gen.stats()["num_running"] == 0:
            await asyncio.sleep(0.005)
        await asyncio.to_thread(gen.shutdown)
        return cut, stats, after, await left

    try:
        ((_, _, deltas), whole), stats, after, (_, _, left) = run(main())
    finally:
        gen.shutdown()
    assert (deltas[-1].finish_reason, deltas[-1].abort_cause) == ("abort", AbortCause.PAUSE)
    assert all(d.finish_reason is None for d in deltas[:-1])
    (sample,) = whole.samples
    assert (sample.finish_reason, sample.abort_cause) == ("abort", AbortCause.PAUSE)
    assert 0 < len(sample.token_ids) < 900 and whole.finished
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert len(after.samples[0].token_ids) == 5 and after.samples[0].finish_reason == "length"
    assert (left[-1].finish_reason, left[-1].abort_cause) == ("abort", AbortCause.SHUTDOWN)


@pytest.mark.parametrize("fuse", ["off", "on"])
def test_update_weights_changes_outputs_and_policy_version(setups, tiny_path, overlap, fuse):
    """Also with fused projections, whose parameters are views of the fused weights: the
    update's in-place copies reach the fused matmuls."""
    from areno.models.tiny import build_tiny

    setup = setups("qwen3_5")
    x = setup.encode(text("Which weights am I?"))
    other_path = build_tiny("qwen3_5", tiny_path("qwen3_5").parent / "qwen3_5-seed1", seed=1)
    other = Setup(other_path)
    new_weights = dict(other.model.state_dict())
    gen = Generator.from_model(
        Setup(tiny_path("qwen3_5")).model,  # a private copy: the update writes in place
        setup.processor.tokenizer,
        EngineConfig(
            max_running_prompts=2,
            max_context_len=512,
            overlap_steps=overlap,
            fuse_projections=fuse,
            cpu_packed_linear=False,
        ),
    )
    assert (gen.core.executor.runner.fused is not None) == (fuse == "on")
    try:
        before = run(gen.generate_all(x, GREEDY))
        with pytest.raises(WeightUpdateError, match="no parameter named"):
            run(gen.update_weights({"not.a.weight": torch.zeros(1)}, version=9))
        name, value = next(iter(new_weights.items()))
        with pytest.raises(WeightUpdateError, match="shape"):
            run(gen.update_weights({name: value[..., :1]}, version=9))
        assert gen.policy_version == 0
        params = {n for n, _ in gen.core.executor.model.named_parameters()}
        count = run(gen.update_weights({n: new_weights[n] for n in params}, version=1))
        after = run(gen.generate_all(x, GREEDY))
    finally:
        gen.shutdown()
    assert count == len(params)
    assert before.policy_version == 0 and after.policy_version == 1
    assert before.samples[0].token_ids == setup.reference(x, GREEDY.max_tokens)
    assert after.samples[0].token_ids == other.reference(x, GREEDY.max_tokens)
    assert after.samples[0].token_ids != before.samples[0].token_ids


def test_weights_landing_mid_request_sample_its_later_tokens_from_the_new_policy(
    setups, tiny_path, overlap
):
    """A request running when new weights land continues on them (what partial rollouts rest
    on): its tokens carry the version of the weights that sampled them, and each token's
    logprob is that policy's given the whole prefix, the tokens before the update included
    (their keys and values were computed again under the new weights)."""
    from areno.models.tiny import build_tiny
    from areno.train.policy import sequence_logprobs

    setup = setups("qwen3_5")
    x = setup.encode(text("Which weights sample me?"))
    other = Setup(build_tiny("qwen3_5", tiny_path("qwen3_5").parent / "qwen3_5-seed1", seed=1))
    models = {0: setup.model, 1: other.model}
    gen = Generator.from_model(
        Setup(tiny_path("qwen3_5")).model,  # a private copy: the update writes in place
        setup.processor.tokenizer,
        EngineConfig(max_running_prompts=2, max_context_len=512, overlap_steps=overlap),
    )
    params = SamplingParams(max_tokens=24, ignore_eos=True, seed=5, logprobs=True)
    names = {n for n, _ in gen.core.executor.model.named_parameters()}
    new_weights = {n: w for n, w in other.model.state_dict().items() if n in names}

    async def main():
        stream = gen.generate(x, params)
        outputs = [await anext(stream)]  # its first tokens, sampled by policy 0
        await gen.pause("keep")  # the request stays in its slot, unfinished
        await gen.update_weights(new_weights, version=1)
        await gen.resume()
        outputs += [output async for output in stream]
        return merge_outputs(outputs).samples[0]

    try:
        sample = run(main())
    finally:
        gen.shutdown()
    versions = sample.policy_versions
    switch = versions.index(1)
    assert switch > 0 and versions == [0] * switch + [1] * (len(versions) - switch)
    assert len(sample.token_ids) == 24
    whole = x.with_tokens(x.input_ids + list(sample.token_ids))
    with torch.no_grad():
        expected = {
            v: sequence_logprobs(m, whole, "cpu", x.num_prompt_tokens) for v, m in models.items()
        }
    for i, (version, logprob) in enumerate(zip(versions, sample.logprobs, strict=True)):
        assert logprob == pytest.approx(expected[version][i].item(), abs=1e-4), (i, version)
    # the two policies disagree after the switch: the check above tells them apart
    after = slice(switch, None)
    assert not torch.allclose(expected[0][after], expected[1][after], atol=1e-2)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_start_up_prompts_run_every_media_tower_and_change_no_output(setups, media, family):
    from areno.processing.warmup import warm_up_prompts

    setup = setups(family)
    model = setup.model.model
    towers = {"image": 0, "audio": 0, "video": 0}
    features = {m: f"get_{m}_features" for m in towers if hasattr(model, f"get_{m}_features")}

    def counted(modality: str, inner):
        def call(*args, **kwargs):
            towers[modality] += 1
            return inner(*args, **kwargs)

        return call

    for modality, name in features.items():
        setattr(model, name, counted(modality, getattr(model, name)))
    requests = mixed_requests(setup, media)
    try:
        cold = setup.generator()
        try:
            expected = [run(cold.generate_all(r, GREEDY)).samples[0].token_ids for r in requests]
        finally:
            cold.shutdown()
        prompts = warm_up_prompts(setup.processor)
        assert set(prompts) == set(setup.processor.adapter.modalities)
        towers.update(dict.fromkeys(towers, 0))
        warmed = setup.generator()
        try:
            warmed.warm_up(prompts)
            ran = dict(towers)
            got = [run(warmed.generate_all(r, GREEDY)).samples[0].token_ids for r in requests]
        finally:
            warmed.shutdown()
    finally:
        for name in features.values():
            delattr(model, name)  # back to the class's method
    for modality in setup.processor.adapter.modalities:
        assert ran[modality] >= 1, (modality, ran)
    assert got == expected


def test_a_failing_start_up_prompt_is_named_and_leaves_the_engine_serving(setups):
    import dataclasses

    from areno.engine.generator import StartupRunError
    from areno.processing.warmup import warm_up_prompts

    setup = setups("qwen3_5")
    image = warm_up_prompts(setup.processor)["image"]
    pixels = image.mm_inputs["pixel_values"]
    broken = dataclasses.replace(image, mm_inputs={**image.mm_inputs, "pixel_values": pixels[:3]})
    gen = setup.generator()
    try:
        with pytest.raises(StartupRunError, match="start-up run of its image prompt failed"):
            gen.warm_up({"image": broken})
        request = setup.encode(text("Still there?"))
        assert len(run(gen.generate_all(request, GREEDY)).samples[0].token_ids) > 0
    finally:
        gen.shutdown()


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_the_cache_is_allocated_whole_at_start_up(setups, family):
    """Every layer's storage exists before the first request, and the allocator counted it."""
    gen = setups(family).generator()
    try:
        cache = gen.core.executor.runner.cache
        storages = [t for layer in cache.attention.values() for t in (layer.keys, layer.values)]
        storages += [t for s in cache.linear.values() for t in (s.conv, s.recurrent)]
        assert all(t is not None for t in storages)
        assert cache.allocator.num_bytes == sum(t.nbytes for t in storages) > 0
    finally:
        gen.shutdown()


def test_a_cache_too_large_for_memory_fails_at_start_up_naming_the_flags(setups):
    """A pool of twice the memory this machine has available: the start-up fails with
    CacheMemoryError before allocating its first layer, and an engine of sane size starts
    right after."""
    from areno.engine.layers.cache import available_bytes
    from areno.errors import CacheMemoryError

    setup = setups("qwen3_5")
    gib = 2 * available_bytes(torch.device("cpu"))[0] / (1 << 30)
    with pytest.raises(CacheMemoryError) as raised:
        setup.generator(kv_cache_gib=gib)
    message = str(raised.value)
    # the tiny model has one full-attention layer: its keys are half the pool
    assert "GiB for layer 1's keys" in message
    assert "blocks of 16 tokens" in message and "--kv-cache-gib" in message
    assert isinstance(raised.value, ConfigError) and raised.value.code == "cache_too_large"
    gen = setup.generator()
    try:
        out = run(gen.generate_all(setup.encode(text("Hi")), GREEDY))
    finally:
        gen.shutdown()
    assert out.samples[0].token_ids


def test_a_linear_state_dtype_other_than_fp32_or_bf16_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"linear_state_dtype must be one of .*; got 'float16'"):
        EngineConfig(linear_state_dtype="float16")
    assert EngineConfig().linear_state_dtype == "float32"


def test_a_bare_off_turns_graphs_and_compiling_off_and_a_bare_on_names_the_field() -> None:
    # `--set rollout.engine.decode_compile=off` and a config file's `decode_compile: off` both
    # reach the engine as YAML's false.
    import yaml

    off = yaml.safe_load("off")
    config = EngineConfig(decode_graphs=off, decode_compile=off, prefill_compile=off)
    assert (config.decode_graphs, config.decode_compile, config.prefill_compile) == ("off",) * 3
    # `on` names no graph or compile mode: refused, naming the field and what it takes
    with pytest.raises(
        ConfigError, match=r"decode_compile must be one of .*'inductor'.*; got True"
    ):
        EngineConfig(decode_compile=yaml.safe_load("on"))
