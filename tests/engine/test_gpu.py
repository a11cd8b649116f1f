"""CUDA paths of the engine (run on a GPU machine; skipped elsewhere)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areno.engine.config import EngineConfig
from areno.engine.generator import Generator
from areno.engine.runner.model_runner import ModelRunner
from areno.engine.sampling import SamplingParams
from areno.media.samples import write_image, write_video
from areno.processing.types import PromptInputs
from tests.engine.generating import (
    GREEDY,
    Setup,
    arrive_together,
    run_chunked,
    text,
    with_media,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FAMILIES = ["qwen3_5", "qwen3_vl", "minicpmv4_6", "gemma4"]
SLOTS = [7, 2, 5, 0, 3]


def staggered_greedy(
    model, graphs: str, prompts: list[list[int]], num_new: int, captured: set | None = None
) -> list[list[int]]:
    """Requests join one per step into scattered slots while the others decode. `captured`
    collects the (rows, key length) of every graph the runner captured."""
    runner = ModelRunner(model, num_slots=8, max_len=512, graphs=graphs)
    running, done = [], {}
    pending = list(enumerate(prompts))
    while pending or running:
        if pending:
            index, ids = pending.pop(0)
            slot = SLOTS[index]  # scattered, never reused while running
            logits = runner.prefill(PromptInputs(ids, {}), [slot])
            running.append(
                {"i": index, "slot": slot, "pos": len(ids), "out": [int(logits.argmax())]}
            )
        logits = runner.decode(
            [r["slot"] for r in running],
            [r["pos"] for r in running],
            [r["out"][-1] for r in running],
        )
        for row, r in enumerate(running):
            r["out"].append(int(logits[row].argmax()))
            r["pos"] += 1
        for r in [r for r in running if len(r["out"]) >= num_new]:
            done[r["i"]] = r["out"][:num_new]
            running.remove(r)
    if captured is not None and runner.graphs is not None:
        captured |= set(runner.graphs._graphs)
    return [done[i] for i in range(len(prompts))]


def decode_alike(alone: ModelRunner, together: ModelRunner, prompts, tokens: list[int]) -> None:
    """Four greedy decode steps of SLOTS after `prompts` give both runners the same logits."""
    positions = [p.num_prompt_tokens for p in prompts]
    for _ in range(4):
        step = alone.decode(SLOTS, positions, tokens)
        assert torch.allclose(together.decode(SLOTS, positions, tokens), step, atol=1e-3)
        positions = [n + 1 for n in positions]
        tokens = step.argmax(-1).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graph_decode_equals_eager(tiny_path, family):
    from areno.models import get_adapter
    from areno.models.registry import read_model_type

    path = tiny_path(family)
    model = get_adapter(read_model_type(path)).load_model(path, dtype=torch.float32).cuda()
    torch.manual_seed(0)
    prompts = [torch.randint(5, 500, (n,)).tolist() for n in (9, 40, 17, 300, 3)]
    eager = staggered_greedy(model, "off", prompts, 12)
    captured = set()
    graphed = staggered_greedy(model, "capture", prompts, 12, captured)
    assert graphed == eager
    # One graph per row bucket, none per context length: the steps' longest rows had up to 52
    # keys (one 128-key bucket) and then 300 to 312 (another), all under one captured length.
    assert len({kv_len for _, kv_len in captured}) == 1, captured


@pytest.mark.parametrize(
    ("family", "prefill_compile"),
    [(family, "off") for family in FAMILIES] + [("qwen3_5", "inductor"), ("gemma4", "inductor")],
)
def test_a_padded_prefill_equals_one_at_a_time_on_cuda(tiny_path, family, prefill_compile):
    """Prompts of unequal lengths in one right-padded prefill (the Triton gated-delta kernel
    for Qwen3.5's linear attention), also with the text stack compiled by inductor, give each
    prompt's own logits and decode steps."""
    from areno.models import get_adapter
    from areno.models.registry import read_model_type

    path = tiny_path(family)
    model = get_adapter(read_model_type(path)).load_model(path, dtype=torch.float32).cuda()
    torch.manual_seed(0)
    prompts = [PromptInputs(torch.randint(5, 500, (n,)).tolist(), {}) for n in (9, 40, 17, 300, 3)]
    alone = ModelRunner(model, num_slots=8, max_len=512, graphs="off")
    together = ModelRunner(
        model, num_slots=8, max_len=512, graphs="off", prefill_compile=prefill_compile
    )
    together.prefill(prompts[0], [SLOTS[0]])  # the cache allocates uncompiled, as the engine's
    slots = [[s] for s in SLOTS]
    want = torch.stack([alone.prefill(p, s) for p, s in zip(prompts, slots, strict=True)])
    have = together.prefill_batch(prompts, slots)
    assert torch.allclose(have, want, atol=1e-3)
    assert together.prefill_compiled == (prefill_compile != "off")
    decode_alike(alone, together, prompts, want.argmax(-1).tolist())


@pytest.mark.parametrize(
    ("family", "prefill_compile"),
    [("qwen3_5", "off"), ("qwen3_vl", "off"), ("qwen3_5", "inductor"), ("gemma4", "inductor")],
)
def test_parts_of_prompts_in_one_forward_equal_whole_prefills_on_cuda(
    tiny_path, family, prefill_compile
):
    """Parts of prompts of unequal lengths in one forward over their slots' cached keys
    (`prefill_parts`; the Triton gated-delta kernel continuing each row's state), also with the
    text stack compiled by inductor, give each prompt's own last logits and decode steps."""
    from areno.engine.runner.batched_prefill import PromptPart
    from areno.models import get_adapter
    from areno.models.registry import read_model_type

    path = tiny_path(family)
    model = get_adapter(read_model_type(path)).load_model(path, dtype=torch.float32).cuda()
    torch.manual_seed(0)
    prompts = [PromptInputs(torch.randint(5, 500, (n,)).tolist(), {}) for n in (9, 40, 17, 300, 3)]
    cuts = [4, 33, 17, 100, 1]
    alone = ModelRunner(model, num_slots=8, max_len=512, graphs="off")
    together = ModelRunner(
        model, num_slots=8, max_len=512, graphs="off", prefill_compile=prefill_compile
    )
    together.prefill(prompts[0], [SLOTS[0]])  # the cache allocates uncompiled, as the engine's
    want = torch.stack([alone.prefill(p, [s]) for p, s in zip(prompts, SLOTS, strict=True)])
    together.prefill_batch([prompts[1]] * len(SLOTS), [[s] for s in SLOTS])  # earlier states
    first = [
        PromptPart(p, s, None, 0, c, True) for p, s, c in zip(prompts, SLOTS, cuts, strict=True)
    ]
    together.prefill_parts(first)
    rest = [
        PromptPart(p, s, None, c, p.num_prompt_tokens, False)
        for p, s, c in zip(prompts, SLOTS, cuts, strict=True)
        if c < p.num_prompt_tokens
    ]
    have = together.prefill_parts(rest)
    assert torch.allclose(have, want[[0, 1, 3, 4]], atol=1e-3)
    assert together.parts_compiled == (prefill_compile != "off")
    decode_alike(alone, together, prompts, want.argmax(-1).tolist())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_graphs_on_a_second_gpu_after_the_first_captured(tiny_path):
    # torch.cuda.graph's default capture stream belongs to the GPU that captured first; a runner
    # on another GPU must capture on its own stream (else nothing is recorded and replays return
    # the capture's stale logits).
    from areno.models import get_adapter
    from areno.models.registry import read_model_type

    path = tiny_path("qwen3_5")
    torch.manual_seed(0)
    prompts = [torch.randint(5, 500, (n,)).tolist() for n in (9, 40, 17)]
    results = {}
    for device in ("cuda:0", "cuda:1"):
        model = get_adapter(read_model_type(path)).load_model(path, dtype=torch.float32)
        model = model.to(device)
        for graphs in ("capture", "off"):
            results[device, graphs] = staggered_greedy(model, graphs, prompts, 12)
    assert results["cuda:1", "capture"] == results["cuda:1", "off"] == results["cuda:0", "off"]
    assert results["cuda:0", "capture"] == results["cuda:0", "off"]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl", "gemma4"])
def test_media_prompts_prefilled_in_chunks_on_cuda(tiny_path, tmp_path, family):
    """A budget of 8 prompt tokens a step on CUDA (float32), a video prompt chunked through its
    frames while a short request decodes: Qwen3.5's linear-attention continuation runs the
    Triton kernels, Gemma 4's sliding layers their rings and bidirectional frames, the decode
    the paged kernel in captured graphs; the tokens equal transformers' on the same GPU."""
    setup = Setup(tiny_path(family))
    setup.model.cuda()
    video = str(write_video(tmp_path / "v.mp4", seconds=2.0, fps=4.0))
    inputs = [
        setup.encode(text("Hi.")),
        setup.encode(with_media("video", video, "Describe it for me, and " * 4)),
    ]
    expected = [setup.reference(x, GREEDY.max_tokens) for x in inputs]
    gen = setup.generator(max_num_batched_tokens=8, block_size=4)
    try:
        outputs, chunks = run_chunked(gen, inputs)
    finally:
        gen.shutdown()
    assert [o.samples[0].token_ids for o in outputs] == expected
    (span,) = inputs[1].mm_spans
    assert sum(1 for _, start, end in chunks if start < span.end and span.start < end) >= 4


def test_generator_on_cuda_bf16(tiny_path):
    config = EngineConfig(max_running_prompts=4, max_context_len=256, fuse_projections="auto")
    gen = Generator.from_config(tiny_path("qwen3_5"), config)
    try:
        out = asyncio.run(
            gen.generate_all(
                PromptInputs(list(range(10, 40)), {}),
                SamplingParams(max_tokens=16, ignore_eos=True, n=3, seed=0, logprobs=True),
            )
        )
    finally:
        gen.shutdown()
    assert gen.core.executor.device.type == "cuda"
    assert gen.core.executor.runner.fused is not None
    assert [len(s.token_ids) for s in out.samples] == [16, 16, 16]
    assert all(lp <= 0 for s in out.samples for lp in s.logprobs)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_products_of_one_row_on_the_kernel_give_cublas_tokens_on_cuda(
    tiny_path, family, monkeypatch
):
    """`one_row_gemv` on: a lone request's prompt logits and its compiled, captured one-row
    decode steps run the matrix-vector kernel, and the greedy tokens are those of cuBLAS."""
    import areno.engine.kernels.gemv as gemv_kernel

    calls = [0]
    kernel = gemv_kernel.gemv

    def counted(*args, **kwargs):
        calls[0] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(gemv_kernel, "gemv", counted)
    tokens = {}
    for mode in ("off", "on"):
        config = EngineConfig(
            max_running_prompts=2, max_context_len=256, dtype="float32", one_row_gemv=mode
        )
        gen = Generator.from_config(tiny_path(family), config)
        try:
            out = asyncio.run(
                gen.generate_all(
                    PromptInputs(list(range(10, 40)), {}),
                    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                )
            )
        finally:
            gen.shutdown()
        tokens[mode] = out.samples[0].token_ids
        assert calls[0] == 0 if mode == "off" else calls[0] > 0
    assert len(tokens["on"]) == 16 and tokens["on"] == tokens["off"]


def test_an_engine_at_a_memory_fraction_stays_within_it_on_cuda(tiny_path, tmp_path):
    """The pool takes the engine's share less what runs beside it (kv_pool.reserved_bytes):
    with image and video prompts (as large as the tiny processor makes them) and every slot
    penalised and reporting logprobs, the process's peak stays within the fraction it was
    given (the towers' activations inside the margin)."""
    setup = Setup(tiny_path("qwen3_5"))
    setup.model.cuda()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    total = torch.cuda.mem_get_info()[1]
    fraction = min((torch.cuda.memory_allocated() + (4 << 30)) / total, 0.9)
    image = str(write_image(tmp_path / "big.png", 1536, 1536))
    video = str(write_video(tmp_path / "long.mp4", seconds=16.0, fps=4.0, width=256, height=256))
    gen = setup.generator(
        max_running_prompts=32, max_context_len=4096, kv_cache_memory_fraction=fraction
    )
    try:
        params = SamplingParams(max_tokens=8, presence_penalty=0.5, logprobs=True, top_logprobs=5)
        prompts = [setup.encode(with_media(kind, url, "Describe.")) for kind, url in
                   (("image", image), ("video", video))]  # fmt: skip
        prompts += [setup.encode(text(f"Tell me about the number {i}.")) for i in range(30)]
        outs = asyncio.run(arrive_together(gen, prompts, params))
    finally:
        gen.shutdown()
    assert all(len(out.samples[0].token_ids) >= 1 for out in outs)
    assert torch.cuda.max_memory_allocated() <= fraction * total


def test_weights_from_device_memory_are_copied_before_update_weights_returns(tiny_path):
    """A sender on this GPU (CUDA IPC from a colocated trainer) may change its tensors as soon
    as update_weights returns: the copies must have run by then, not merely be queued. The
    stream is held busy first, so queued copies would still be waiting behind it."""
    gen = Generator.from_config(tiny_path("qwen3_vl"), EngineConfig(max_running_prompts=2))
    try:
        model = gen.core.executor.model
        weights = {name: (p.detach() * 0.5).clone() for name, p in model.named_parameters()}
        torch.cuda._sleep(2_000_000_000)  # ~1 s of a busy stream
        assert asyncio.run(gen.update_weights(weights, 1)) == len(weights)
        assert torch.cuda.current_stream().query()
        for name, param in model.named_parameters():
            assert torch.equal(param, weights[name]), name
    finally:
        gen.shutdown()


def test_a_bf16_linear_state_decodes_the_fp32_states_greedy_tokens_on_cuda(tiny_path):
    """Qwen3.5's gated-delta-net states stored in bf16 (`linear_state_dtype`), read and written
    by the Triton kernel through captured, compiled steps: the same greedy tokens as fp32."""
    prompts = [PromptInputs(list(range(10 + i, 40 + 3 * i)), {}) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for state_dtype in ("float32", "bfloat16"):
        config = EngineConfig(
            max_running_prompts=4, max_context_len=256, linear_state_dtype=state_dtype
        )
        gen = Generator.from_config(tiny_path("qwen3_5"), config)

        async def run_all(gen=gen):
            return await asyncio.gather(*(gen.generate_all(p, params) for p in prompts))

        try:
            tokens[state_dtype] = [out.samples[0].token_ids for out in asyncio.run(run_all())]
            states = gen.core.executor.runner.cache.linear.values()
            assert {s.recurrent.dtype for s in states} == {getattr(torch, state_dtype)}
        finally:
            gen.shutdown()
    assert tokens["bfloat16"] == tokens["float32"]


def test_overlapped_steps_give_the_steps_own_outputs(tiny_path):
    """A step launched before the host reads the previous one's tokens (`overlap_steps`) gives
    what reading each step first gives: greedy and seeded rows, n > 1, staggered lengths, and
    a stop token read one step late (its sequence decodes a dropped extra step)."""
    prompts = [PromptInputs(list(range(10 + i, 40 + 3 * i)), {}) for i in range(5)]

    def run(overlap: bool, stop_token_ids=()) -> list:
        config = EngineConfig(
            max_running_prompts=4,
            max_context_len=256,
            dtype="float32",
            decode_compile="off",
            overlap_steps="on" if overlap else "off",
        )
        gen = Generator.from_config(tiny_path("qwen3_5"), config)
        params = [
            SamplingParams(
                max_tokens=6 + 4 * i,
                temperature=0.8 if i % 2 else 0.0,
                seed=i,
                n=2 if i == 3 else 1,
                ignore_eos=True,
                stop_token_ids=list(stop_token_ids),
                logprobs=True,
            )
            for i in range(len(prompts))
        ]

        async def main():
            return await asyncio.gather(
                *(gen.generate_all(x, p) for x, p in zip(prompts, params, strict=True))
            )

        try:
            outputs = asyncio.run(main())
        finally:
            gen.shutdown()
        assert gen.core.overlap is overlap
        return [s for out in outputs for s in out.samples]

    plain = run(False)
    stop = plain[2].token_ids[3]  # a token the third request draws mid-way
    for stops in ((), (stop,)):
        want, have = run(False, stops), run(True, stops)
        assert [s.token_ids for s in have] == [s.token_ids for s in want]
        assert [s.finish_reason for s in have] == [s.finish_reason for s in want]
        for a, b in zip(have, want, strict=True):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    assert want[2].finish_reason == "stop" and want[2].token_ids[-1] == stop


def _share_weights(shapes, queue, done) -> None:
    """Child process: random CUDA tensors of `shapes`, shared by IPC handle, kept alive until
    the parent has loaded them."""
    from areno.engine.parallel.ipc import CudaIpcWeights

    torch.manual_seed(1)
    tensors = {n: torch.randn(s, dtype=d, device="cuda") for n, (s, d) in shapes.items()}
    queue.put((CudaIpcWeights.share(tensors.items()), {n: t.cpu() for n, t in tensors.items()}))
    done.wait(timeout=120)


def test_update_weights_by_cuda_ipc(tiny_path):
    import multiprocessing

    config = EngineConfig(
        max_running_prompts=2, max_context_len=128, decode_compile="off", fuse_projections="on"
    )
    gen = Generator.from_config(tiny_path("qwen3_5"), config)
    context = multiprocessing.get_context("spawn")
    queue, done = context.Queue(), context.Event()
    try:
        params = dict(gen.core.executor.model.named_parameters())
        names = [n for n in params if "language_model" in n][:4]
        shapes = {n: (tuple(params[n].shape), params[n].dtype) for n in names}
        child = context.Process(target=_share_weights, args=(shapes, queue, done))
        child.start()
        shared, expected = queue.get(timeout=120)
        assert asyncio.run(gen.update_weights(shared, version=3)) == len(names)
        done.set()
        child.join(timeout=60)
        assert gen.policy_version == 3
        for name in names:
            assert torch.equal(params[name].cpu(), expected[name])
    finally:
        done.set()
        gen.shutdown()


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_questions_after_a_shared_system_prompt_resume_with_prefills_compiled_on_cuda(
    tiny_path, family
):
    """On CUDA (float32) with the prefill compiled by inductor, decode graphs captured: text
    prompts save their states at checkpoints in compiled parts, so questions after one shared
    system prompt resume where they part (>= 90% cached from the third) and a prompt sent again
    at its last full block; every reply is the cold engine's, and nothing compiles after
    start-up."""
    from tests.engine.generating import frames_compiled

    setup = Setup(tiny_path(family))
    setup.model.cuda()
    system = "You are a careful assistant who answers about rivers and seas. " * 10
    questions = ["where does the river go?", "why is the sea salty?", "name a long river."]
    prompts = [
        setup.encode([{"role": "system", "content": system}, *text(f"Question {i}: {q}")])
        for i, q in enumerate(questions, start=1)
    ]
    prompts.append(prompts[0])
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = {}
    for cache in (False, True):
        gen = setup.generator(
            block_size=4,
            enable_prefix_caching=cache,
            prefix_checkpoint_blocks=8,
            decode_compile="off",
            prefill_compile="inductor" if cache else "off",
        )
        compiled_at_start = frames_compiled()
        try:
            outputs = [asyncio.run(gen.generate_all(x, greedy)) for x in prompts]
        finally:
            gen.shutdown()
        results[cache] = [(o.samples[0].token_ids, o.num_cached_tokens) for o in outputs]
    assert gen.core.executor.runner.parts_compiled
    assert frames_compiled() == compiled_at_start
    assert [t for t, _ in results[True]] == [t for t, _ in results[False]]
    cached = [c for _, c in results[True]]
    assert cached[0] == 0 and cached[1] > 0, cached
    for count, x in zip(cached[2:], prompts[2:], strict=True):
        assert count >= 0.9 * x.num_prompt_tokens, cached


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl", "gemma4"])
def test_prefix_cache_on_cuda_gives_the_cold_engine_tokens(tiny_path, tmp_path, family):
    """On CUDA (float32, decode graphs captured, saves and restores beside them): an episode of
    three turns whose tool returns an image, sent token in, and the same image prompt again,
    give the cold engine's tokens and logprobs; the later turns resume from the cache."""
    from areno.media.samples import write_image
    from tests.engine.test_prefix_cache import _episode

    setup = Setup(tiny_path(family))
    setup.model.cuda()
    image = str(write_image(tmp_path / "a.png", 64, 48))
    other = str(write_image(tmp_path / "b.png", 64, 48, seed=3))
    first = setup.encode(with_media("image", image, "Describe it, please, in a few words."))
    greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=True, ignore_eos=True)
    results = {}
    for cache in (False, True):
        # graphs captured, not compiled (the compile is other tests' and costs minutes)
        gen = setup.generator(block_size=4, enable_prefix_caching=cache, decode_compile="off")
        try:
            turns = _episode(setup, gen, first, [other, image], greedy)
            before = gen.stats()["num_prompt_tokens_cached"]
            again = asyncio.run(gen.generate_all(first, greedy)).samples[0]
            cached = gen.stats()["num_prompt_tokens_cached"] - before
        finally:
            gen.shutdown()
        results[cache] = turns, again, cached
    (cold, cold_again, _), (warm, warm_again, cached) = results[False], results[True]
    for a, b in zip(cold, warm, strict=True):
        assert b[0] == a[0]
        assert b[1] == pytest.approx(a[1], abs=1e-3)
    assert warm_again.token_ids == cold_again.token_ids
    assert all(turn[2] > 0 for turn in warm[1:]) and cached > 0
