"""Slot-cache runner: batched decode of staggered, mixed requests equals transformers' generate."""

from __future__ import annotations

import pytest
import torch

from areno.engine.runner.batched_prefill import PromptPart, can_batch_prefill
from areno.engine.runner.cuda_graphs import row_buckets
from areno.engine.runner.model_runner import ModelRunner
from areno.engine.runner.prefills import MAX_PREFILL_PADDING, prefill_groups
from areno.media import MediaDecoder, MediaPolicy
from areno.media.samples import write_audio, write_image, write_video
from areno.processing import Processor, process_messages
from areno.processing.types import PromptInputs

NUM_NEW = 10
FAMILIES = ["qwen3_5", "qwen3_vl", "minicpmv4_6", "gemma4"]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("runner-media")
    return {
        "image": write_image(d / "a.png", 64, 48),
        "video": write_video(d / "v.mp4", seconds=2.0, fps=4.0),
        "audio": write_audio(d / "a.wav", seconds=1.0),
    }


def requests(media, modalities):
    reqs = [
        [{"role": "user", "content": "Hello there, how are you doing today my friend?"}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": str(media["image"])}},
                    {"type": "text", "text": "Describe."},
                ],
            }
        ],
        [{"role": "user", "content": "Short."}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": str(media["video"])}},
                    {"type": "text", "text": "What happens?"},
                ],
            }
        ],
    ]
    if "audio" in modalities:
        reqs.append(
            [
                {
                    "role": "user",
                    "content": [{"type": "audio_url", "audio_url": {"url": str(media["audio"])}}],
                }
            ]
        )
    return reqs


def load(tiny_path, family):
    processor = Processor(tiny_path(family))
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    return processor, decoder, processor.adapter.load_model(tiny_path(family)).eval()


@pytest.mark.parametrize("graphs", ["off", "static"])
@pytest.mark.parametrize("family", FAMILIES)
def test_staggered_batched_greedy_equals_generate(tiny_path, media, family, graphs):
    processor, decoder, model = load(tiny_path, family)
    inputs = [
        process_messages(processor, decoder, r)
        for r in requests(media, processor.adapter.modalities)
    ]
    expected = []
    for x in inputs:
        out = model.generate(
            **x.model_inputs(), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False
        )
        expected.append(out[0, x.num_prompt_tokens :].tolist())

    # generate's min_new_tokens bans EOS; ban it here too so both run NUM_NEW steps.
    eos = model.generation_config.eos_token_id
    eos = torch.tensor(eos if isinstance(eos, list) else [eos])

    def greedy(logits):
        return int(logits.index_fill(-1, eos, float("-inf")).argmax())

    # "static" is the padded, static-buffer step that CUDA graphs capture, run eagerly here.
    runner = ModelRunner(model, num_slots=8, max_len=1024, graphs=graphs)
    running: list[dict] = []
    done: dict[int, list[int]] = {}
    pending = list(enumerate(inputs))
    step = 0
    while pending or running:
        # One new request joins every other step, while the others keep decoding.
        if pending and step % 2 == 0:
            index, x = pending.pop(0)
            slot = 7 - index  # slots need not follow arrival order
            token = greedy(runner.prefill(x, [slot]))
            running.append(
                {"index": index, "slot": slot, "pos": x.num_prompt_tokens, "out": [token]}
            )
        elif running:
            logits = runner.decode(
                [r["slot"] for r in running],
                [r["pos"] for r in running],
                [r["out"][-1] for r in running],
            )
            for row, r in enumerate(running):
                r["out"].append(greedy(logits[row]))
                r["pos"] += 1
        for r in [r for r in running if len(r["out"]) == NUM_NEW]:
            done[r["index"]] = r["out"]
            running.remove(r)
        step += 1
    for i, want in enumerate(expected):
        assert done[i] == want, (i, done[i], want)


def test_one_compile_of_the_decode_step_serves_every_row_bucket(tiny_path):
    # The tiny model has 2 KV heads: with duck sizing, a first compile at the 2-row bucket made
    # the row count the KV-head count's symbol, pinned it, and each other bucket recompiled.
    from torch._dynamo.utils import counters

    _, _, model = load(tiny_path, "qwen3_5")
    runner = ModelRunner(model, num_slots=8, max_len=64, graphs="static", compile="eager")
    for slot in range(6):
        runner.prefill(PromptInputs([5 + slot, 9, 11], {}), [slot])
    runner.decode([0], [3], [7])  # the 2-row bucket: the compile
    compiled = counters["stats"]["unique_graphs"]
    runner.decode([0, 1, 2], [4, 3, 3], [7, 8, 9])  # 4 rows
    runner.decode(list(range(6)), [5, 4, 4, 3, 3, 3], [7] * 6)  # 8 rows
    assert runner.graphs.compiled
    assert counters["stats"]["unique_graphs"] == compiled


def test_one_compile_of_the_decode_step_serves_every_key_bucket_up_to_the_whole_context(
    tiny_path,
):
    # The last key bucket is the whole context (200 here, the buckets are 128 keys): when it
    # was also the whole storage, its keys were a contiguous view and the step compiled again.
    # aot_eager: the guard came from tracing the step's layouts, which the "eager" backend skips.
    from torch._dynamo.utils import counters

    from areno.engine import compile_cache

    _, _, model = load(tiny_path, "qwen3_5")
    runner = ModelRunner(model, num_slots=4, max_len=200, graphs="static", compile="aot_eager")
    for slot in range(2):
        runner.prefill(PromptInputs([5 + slot, 9, 11], {}), [slot])
    runner.decode([0, 1], [3, 3], [7, 8])  # 128 keys: the compile
    # A graph traced to be saved, where an earlier test set up a compile cache, counts too.
    compiled = counters["stats"]["unique_graphs"] + compile_cache.traces["traced"]
    runner.decode([0, 1], [199, 4], [7, 8])  # 200 keys: every position of the context
    assert runner.graphs.compiled
    assert counters["stats"]["unique_graphs"] + compile_cache.traces["traced"] == compiled


@pytest.mark.parametrize("family", FAMILIES)
def test_the_compiled_decode_step_is_one_graph(tiny_path, family):
    # A break (Qwen3.5's gated-delta-net update once left the graph) splits the step into frames
    # that dynamo compiles once per layer; past its limit of 8 the later layers ran uncompiled.
    from torch._dynamo.utils import counters

    _, _, model = load(tiny_path, family)
    runner = ModelRunner(model, num_slots=4, max_len=64, graphs="static", compile="eager")
    for slot in range(2):
        runner.prefill(PromptInputs([5 + slot, 9, 11], {}), [slot])
    torch._dynamo.reset()  # an earlier test's compile of this family would be reused, unseen
    counters.clear()
    runner.decode([0, 1], [3, 3], [7, 8])
    assert runner.graphs.compiled
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1


def test_forked_samples_share_one_prefill(tiny_path, media):
    processor, decoder, model = load(tiny_path, "qwen3_5")
    x = process_messages(processor, decoder, requests(media, {"image"})[1])
    runner = ModelRunner(model, num_slots=4, max_len=512)
    first = int(runner.prefill(x, [1, 3]).argmax())
    logits = runner.decode([1, 3], [x.num_prompt_tokens] * 2, [first, first])
    assert (logits[0] - logits[1]).abs().max() < 1e-5, (logits[0] - logits[1]).abs().max()


def test_decode_logprobs_match_a_full_forward(tiny_path, media):
    processor, decoder, model = load(tiny_path, "gemma4")
    x = process_messages(processor, decoder, requests(media, {"image"})[1])
    runner = ModelRunner(model, num_slots=2, max_len=512)
    tokens = [int(runner.prefill(x, [0]).argmax())]
    logps = []
    for i in range(5):
        logits = runner.decode([0], [x.num_prompt_tokens + i], [tokens[-1]])
        logps.append(torch.log_softmax(logits[0], -1))
        tokens.append(int(logits[0].argmax()))
    full = dict(x.model_inputs())
    full["input_ids"] = torch.tensor([x.input_ids + tokens[:-1]])
    full["attention_mask"] = torch.ones_like(full["input_ids"])
    full["mm_token_type_ids"] = torch.nn.functional.pad(full["mm_token_type_ids"], (0, 5))
    with torch.no_grad():
        ref = torch.log_softmax(model(**full).logits[0, -5:].float(), -1)
    for i in range(5):
        assert torch.allclose(logps[i], ref[i], atol=1e-4), i


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_prefill_equals_one_at_a_time(tiny_path, family):
    processor, decoder, model = load(tiny_path, family)
    base = process_messages(processor, decoder, [{"role": "user", "content": "Count to ten."}])
    # Same length, different prompts: change one token of the user's text.
    prompts = [base]
    for token_id in (40, 41):
        ids = list(base.input_ids)
        ids[-6] = token_id
        prompts.append(PromptInputs(ids, base.mm_inputs))
    assert len({tuple(p.input_ids) for p in prompts}) == 3
    assert all(can_batch_prefill(p) for p in prompts)
    alone = ModelRunner(model, num_slots=6, max_len=256)
    together = ModelRunner(model, num_slots=6, max_len=256)
    want = torch.stack([alone.prefill(p, [2 * i]) for i, p in enumerate(prompts)])
    have = together.prefill_batch(prompts, [[0], [2, 3], [4]])
    assert torch.allclose(have, want, atol=1e-4)
    n = prompts[0].num_prompt_tokens
    step = alone.decode([0, 2, 4], [n] * 3, [5, 6, 7])
    # slot 3 is the fork of slot 2: it must decode like slot 2.
    forked = together.decode([0, 2, 3, 4], [n] * 4, [5, 6, 6, 7])
    assert torch.allclose(forked[[0, 1, 3]], step, atol=1e-4)
    assert torch.allclose(forked[2], forked[1], atol=1e-5)


def decode_alike(alone: ModelRunner, together: ModelRunner, positions: list[int], tokens):
    """Three greedy decode steps of slots 0, 2, 4 alone and of 0, 2, 3, 4 together (slot 3 a
    fork of slot 2) give the same logits."""
    for _ in range(3):
        step = alone.decode([0, 2, 4], positions, tokens)
        forked = together.decode(
            [0, 2, 3, 4], positions[:2] + positions[1:], tokens[:2] + tokens[1:]
        )
        assert torch.allclose(forked[[0, 1, 3]], step, atol=1e-4)
        assert torch.allclose(forked[2], forked[1], atol=1e-5)
        positions = [n + 1 for n in positions]
        tokens = step.argmax(-1).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_padded_prefill_of_unequal_lengths_equals_one_at_a_time(tiny_path, family):
    """Right-padded prompts of unequal lengths in one forward: the same last logits, and the
    same decode steps after (the pads' keys are overwritten before any query reads them; a
    linear-attention layer's conv and recurrent states are its last real token's, also for a
    prompt shorter than the conv)."""
    processor, decoder, model = load(tiny_path, family)
    chat = [{"role": "user", "content": "Count to ten, slowly, and then back down to one."}]
    long = process_messages(processor, decoder, chat)

    def first(n: int) -> PromptInputs:  # per-token inputs (Gemma's token types) cut alike
        return PromptInputs(long.input_ids[:n], {k: v[:, :n] for k, v in long.mm_inputs.items()})

    prompts = [first(long.num_prompt_tokens - 7), long, first(3)]
    assert all(can_batch_prefill(p) for p in prompts)
    alone = ModelRunner(model, num_slots=6, max_len=256)
    together = ModelRunner(model, num_slots=6, max_len=256)
    assert together.can_pad_prefill
    want = torch.stack([alone.prefill(p, [2 * i]) for i, p in enumerate(prompts)])
    have = together.prefill_batch(prompts, [[0], [2, 3], [4]])
    assert torch.allclose(have, want, atol=1e-4)
    decode_alike(alone, together, [p.num_prompt_tokens for p in prompts], have.argmax(-1).tolist())


@pytest.mark.parametrize("repeats", [1, 8], ids=["short", "past-window"])
@pytest.mark.parametrize("family", FAMILIES)
def test_parts_of_prompts_in_one_forward_equal_whole_prefills(tiny_path, family, repeats):
    """Prompts without media prefilled in parts, several rows' parts of unequal lengths in one
    forward over the keys their slots hold (`prefill_parts`, as chunks and resumptions from the
    prefix cache run): each prompt's last logits and the decode steps after equal a whole
    prefill's. The slots held another prompt before (a part from 0 starts from zero states,
    and reads nothing of the sliding rings' earlier keys), and a part shorter than the conv
    continues the state of the part before it. Past Gemma 4's 64-token window, rows whose
    parts start at different positions read each its own ring window."""
    processor, decoder, model = load(tiny_path, family)
    text = " ".join(["Count to ten, slowly, and then back down to one."] * repeats)
    long = process_messages(processor, decoder, [{"role": "user", "content": text}])
    if repeats > 1:
        assert long.num_prompt_tokens > 2 * 64 + 16

    def first(n: int) -> PromptInputs:
        return PromptInputs(long.input_ids[:n], {k: v[:, :n] for k, v in long.mm_inputs.items()})

    together = ModelRunner(model, num_slots=6, max_len=256, block_size=4)
    assert together.can_prefill_parts
    alone = ModelRunner(model, num_slots=6, max_len=256, block_size=4)
    prompts = [first(long.num_prompt_tokens - 5), long, first(9)]
    want = torch.stack([alone.prefill(p, [2 * i]) for i, p in enumerate(prompts)])
    together.prefill_batch([first(12)] * 3, [[0], [2], [4]])  # earlier occupants' states
    n = [p.num_prompt_tokens for p in prompts]
    cuts = [7, n[1] - 2] if repeats == 1 else [70, n[1] - 3]

    def part(i: int, start: int, end: int) -> PromptPart:
        return PromptPart(prompts[i], 2 * i, None, start, end, first=start == 0)

    have = together.prefill_parts([part(0, 0, cuts[0]), part(1, 0, cuts[1]), part(2, 0, n[2])])
    assert torch.allclose(have[2], want[2], atol=1e-4)
    assert together.chunking_slots == [0, 2]
    have = together.prefill_parts([part(0, cuts[0], n[0]), part(1, cuts[1], n[1])])
    assert torch.allclose(have, want[:2], atol=1e-4)
    assert together.chunking_slots == []
    together.fork_prompt([2, 3], None, n[1])
    decode_alike(alone, together, n, want.argmax(-1).tolist())


@pytest.mark.parametrize("family", FAMILIES)
def test_a_compiled_batched_prefill_is_one_graph_for_every_shape(tiny_path, family):
    """The text stack of a batched prefill compiles once, without breaks, for any number of
    prompts and any lengths, equal or not, and gives the uncompiled runner's logits and
    cache (the decode step after)."""
    from torch._dynamo.utils import counters

    _, _, model = load(tiny_path, family)
    plain = ModelRunner(model, num_slots=6, max_len=80)
    compiled = ModelRunner(model, num_slots=6, max_len=80, prefill_compile="eager")
    for runner in (plain, compiled):  # the cache allocates, uncompiled (as the engine starts)
        runner.prefill(PromptInputs([5, 9, 11], {}), [5])
    torch._dynamo.reset()  # an earlier test's compile of this family would be reused, unseen
    counters.clear()
    # 64: whole chunks of the CPU delta rule (kernels/chunked_delta.py), two of them.
    for lengths in ([3, 5, 4], [6, 6], [9, 12, 10, 11, 12, 9], [64, 57], [2, 2]):
        prompts = [
            PromptInputs([(7 * i + j) % 50 + 3 for j in range(n)], {})
            for i, n in enumerate(lengths)
        ]
        slots = [[i] for i in range(len(prompts))]
        want = plain.prefill_batch(prompts, slots)
        assert torch.allclose(compiled.prefill_batch(prompts, slots), want, atol=1e-5)
        tokens = want.argmax(-1).tolist()
        rows = list(range(len(prompts)))
        step = compiled.decode(rows, lengths, tokens)
        assert torch.allclose(step, plain.decode(rows, lengths, tokens), atol=1e-5)
    assert compiled.prefill_compiled
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_a_compiled_prefill_of_parts_is_two_graphs_for_every_shape(tiny_path, family):
    """The text stack of a forward of parts (`prefill_parts`: chunks, resumptions) compiles
    without breaks into one graph for several rows and one for a row alone, whatever the
    parts' widths (one token included), starts (0 or past cached keys) and row counts; it
    gives the uncompiled runner's logits and cache (the decode step after). Past Gemma 4's
    64-token window, rows read each its own ring window."""
    from torch._dynamo.utils import counters

    _, _, model = load(tiny_path, family)
    plain = ModelRunner(model, num_slots=6, max_len=256, block_size=4)
    compiled = ModelRunner(model, num_slots=6, max_len=256, block_size=4, prefill_compile="eager")
    for runner in (plain, compiled):  # the cache allocates, uncompiled (as the engine starts)
        runner.prefill(PromptInputs([5, 9, 11], {}), [5])
    torch._dynamo.reset()  # an earlier test's compile of this family would be reused, unseen
    counters.clear()
    lengths = [150, 97, 40, 9]
    prompts = [
        PromptInputs([(7 * i + j) % 50 + 3 for j in range(n)], {}) for i, n in enumerate(lengths)
    ]
    # Each step's parts: (prompt, start, end); prompt i runs in slot i.
    steps = [
        [(0, 0, 70), (1, 0, 33), (2, 0, 17)],
        [(0, 70, 71), (1, 33, 60)],  # one token beside 27
        [(3, 0, 9)],  # a row alone
        [(0, 71, 150)],
        [(1, 60, 97), (2, 17, 40)],
    ]
    for parts in steps:
        parts = [PromptPart(prompts[i], i, None, a, b, first=a == 0) for i, a, b in parts]
        want = plain.prefill_parts(parts)
        assert torch.allclose(compiled.prefill_parts(parts), want, atol=1e-5)
    rows = list(range(len(prompts)))
    tokens = [7, 8, 9, 10]
    assert torch.allclose(
        compiled.decode(rows, lengths, tokens), plain.decode(rows, lengths, tokens), atol=1e-5
    )
    assert compiled.parts_compiled
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_a_lone_prompt_beside_a_copy_of_itself_compiles_no_batch_of_one(tiny_path, family):
    """With lone prompts padded (`pad_lone_tokens`, as on a GPU), a lone prompt and a lone
    part run the graphs of two rows, beside a copy of themselves: the batched prefill and the
    prefill of parts are one graph each, never one of a batch of one, and give the uncompiled
    runner's logits and cache (the decode step after). A lone part past the limit runs
    uncompiled."""
    from torch._dynamo.utils import counters

    _, _, model = load(tiny_path, family)
    plain = ModelRunner(model, num_slots=4, max_len=256, block_size=4)
    padded = ModelRunner(
        model, num_slots=4, max_len=256, block_size=4, prefill_compile="eager", pad_lone_tokens=40
    )
    for runner in (plain, padded):  # the cache allocates, uncompiled (as the engine starts)
        runner.prefill(PromptInputs([5, 9, 11], {}), [3])
    torch._dynamo.reset()  # an earlier test's compile of this family would be reused, unseen
    counters.clear()
    prompts = [PromptInputs([(7 * i + j) % 50 + 3 for j in range(n)], {}) for i, n in
               enumerate([12, 5, 9])]  # fmt: skip
    for group, slots in (([1, 2], [[1], [2]]), ([0], [[0]]), ([2], [[2]])):
        chosen = [prompts[i] for i in group]
        want = plain.prefill_batch(chosen, slots)
        assert torch.allclose(padded.prefill_batch(chosen, slots), want, atol=1e-5)
    rows, lengths, tokens = [0, 1, 2], [12, 5, 9], [7, 8, 9]
    step = padded.decode(rows, lengths, tokens)
    assert torch.allclose(step, plain.decode(rows, lengths, tokens), atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    longer = PromptInputs([(5 * j) % 50 + 3 for j in range(120)], {})
    # Each step's parts: (start, end) of `longer` in slot 3, then 0 beside it.
    for spans in [[(0, 30)], [(30, 31)], [(31, 60), (0, 10)], [(60, 120)]]:
        parts = [
            PromptPart(longer if slot == 3 else prompts[0], slot, None, a, b, first=a == 0)
            for slot, (a, b) in zip((3, 0), spans, strict=False)
        ]
        want = plain.prefill_parts(parts)
        assert torch.allclose(padded.prefill_parts(parts), want, atol=1e-5)
    rows, lengths = [3, 0], [120, 10]
    step = padded.decode(rows, lengths, tokens[:2])
    assert torch.allclose(step, plain.decode(rows, lengths, tokens[:2]), atol=1e-5)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 2  # no batch of one, none for the long part


def test_the_compiled_steps_keep_the_cache_sizes_static(tiny_path):
    """Only the batch's sizes are symbols in the compiled decode step and batched prefill, not
    the cache storage's: with a slot-count and a length symbol for every layer's tensors,
    reasoning about them was most of a compile's time (30 s against 16 s for dynamo's trace of
    a 28-layer model on CPU)."""
    from areno.engine.runner.compiled import CompiledForward

    symbolic: dict[str, set[str]] = {"decode": set(), "prefill": set()}

    def recorder(step: str):
        def backend(graph_module, example_inputs):
            for node in graph_module.graph.nodes:
                value = node.meta.get("example_value")
                is_tensor = node.op == "placeholder" and isinstance(value, torch.Tensor)
                if is_tensor and any(isinstance(size, torch.SymInt) for size in value.shape):
                    symbolic[step].add(node.name)
            return graph_module

        return backend

    _, _, model = load(tiny_path, "qwen3_5")
    runner = ModelRunner(model, num_slots=4, max_len=64, graphs="static", compile="off")
    for slot in range(2):
        runner.prefill(PromptInputs([5 + slot, 9, 11], {}), [slot])
    torch._dynamo.reset()
    runner.graphs._model = CompiledForward(runner.model, recorder("decode"), "the decode step")
    runner._prefill_stack = CompiledForward(
        runner._text_stack.forward, recorder("prefill"), "the batched prefill"
    )
    runner.decode([0, 1], [3, 3], [7, 8])
    runner.prefill_batch([PromptInputs([5, 9, 11], {}), PromptInputs([5, 9], {})], [[2], [3]])
    for step, names in symbolic.items():
        assert any("input" in name for name in names), step  # the batch (ids or embeddings)
        storage = ("keys", "values", "conv", "recurrent")
        assert not [n for n in names if n.endswith(storage)], (step, names)


def test_prefill_groups_pad_within_a_bound():
    # Equal lengths only, without padding.
    assert prefill_groups([5, 7, 5, 7, 9], pad=False) == [[0, 2], [1, 3], [4]]
    # With it: ascending, while rows x longest <= 1.25 x the real tokens.
    assert prefill_groups([100, 110, 120, 300, 90, 310], pad=True) == [[4, 0, 1, 2], [3, 5]]
    assert MAX_PREFILL_PADDING == 1.25
    assert prefill_groups([], pad=True) == []


def test_row_buckets():
    assert row_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    # A compiled step skips the one-row bucket (torch.compile would specialize it), unless one
    # row is all there is.
    assert row_buckets(64, min_rows=2) == [2, 4, 8, 16, 32, 48, 64]
    assert row_buckets(1, min_rows=2) == [1]


def test_a_compiled_decode_needs_the_padded_step(tiny_path):
    _, _, model = load(tiny_path, "qwen3_5")
    with pytest.raises(ValueError, match="padded step"):
        ModelRunner(model, num_slots=2, max_len=64, graphs="off", compile="inductor")
    # On CPU an explicit compile with graphs "auto" runs the padded step uncaptured.
    runner = ModelRunner(model, num_slots=2, max_len=64, compile="eager")
    assert runner.graphs is not None and not runner.graphs.capture
