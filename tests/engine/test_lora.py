"""LoRA adapters in the engine (areno/engine/layers/lora.py) against `peft` on plain transformers: a
PEFT adapter directory loaded into the Generator gives peft's greedy tokens, base and adapter
requests in one batch each match their own reference, and adapters that do not fit are refused."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from areno.engine.layers.lora import LoraError, LoraWeights
from areno.train.lora import LoraConfig, apply_lora, export_adapter
from tests.engine.generating import GREEDY, run, text, with_media

FAMILY = "qwen3_5"  # hybrid: linear-attention projections are adapted too


def _adapter(setup, path, out, seed: int, rank: int = 4, modules=None):
    """A PEFT model with random factors large enough to change greedy tokens, saved to `out`."""
    torch.manual_seed(seed)
    base = setup.processor.adapter.load_model(path).eval()
    model = apply_lora(base, LoraConfig(rank=rank, alpha=2 * rank, target_modules=modules))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.normal_(0, 0.3)
    export_adapter(model, path, out)
    return model.eval()


def _reference(model, inputs, max_new_tokens: int) -> list[int]:
    model_inputs = inputs.model_inputs()
    out = model.generate(**model_inputs, max_new_tokens=max_new_tokens, do_sample=False)
    tokens = out[0, inputs.num_prompt_tokens :].tolist()
    eos = set(model.generation_config.eos_token_id)
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


@pytest.fixture(scope="module")
def adapters(setups, tiny_path, tmp_path_factory):
    setup, path = setups(FAMILY), tiny_path(FAMILY)
    root = tmp_path_factory.mktemp("lora")
    first = _adapter(setup, path, root / "first", seed=1)
    second = _adapter(setup, path, root / "second", seed=2, rank=8, modules=["q_proj", "down_proj"])
    return {"first": (root / "first", first), "second": (root / "second", second)}


def test_adapters_and_base_in_one_batch_each_match_their_reference(setups, media, adapters):
    setup = setups(FAMILY)
    prompts = [
        setup.encode(text("Hello there, how are you doing today my friend?")),
        setup.encode(with_media("image", media["image"], "Describe.")),
    ]
    expected = {None: [setup.reference(x, GREEDY.max_tokens) for x in prompts]}
    for name, (_, model) in adapters.items():
        expected[name] = [_reference(model, x, GREEDY.max_tokens) for x in prompts]
    assert expected["first"] != expected[None] and expected["second"] != expected[None]

    gen = setup.generator(max_running_prompts=6, max_loras=2, max_lora_rank=8)

    async def main():
        for name, (directory, _) in adapters.items():
            await gen.load_adapter(name, directory)
        # every request queued while the engine holds, then started together: one batch
        await gen.pause("keep")
        jobs = [
            (name, i, dataclasses.replace(GREEDY, adapter=name))
            for name in expected
            for i in range(len(prompts))
        ]
        tasks = [asyncio.create_task(gen.generate_all(prompts[i], p)) for _, i, p in jobs]
        while gen.stats()["num_waiting"] < len(jobs):
            await asyncio.sleep(0.005)
        await gen.resume()
        outs = await asyncio.gather(*tasks)
        return {
            (name, i): out.samples[0].token_ids
            for (name, i, _), out in zip(jobs, outs, strict=True)
        }

    try:
        got = run(main())
    finally:
        gen.shutdown()
    for (name, i), tokens in got.items():
        assert tokens == expected[name][i], (name, i)


async def _in_later_slots(gen, prompt, adapter_dir):
    """Four requests started together, in slots 0-3: base ones that stop after one token in
    slots 0 and 2, a base one running on in slot 1, an adapter one in slot 3. From the second
    step on, the decoding slots are 1 and 3, neither in the row its position in the step names."""
    await gen.load_adapter("first", adapter_dir)
    short = dataclasses.replace(GREEDY, max_tokens=1)
    jobs = [short, GREEDY, short, dataclasses.replace(GREEDY, adapter="first")]
    await gen.pause("keep")
    tasks = []
    for params in jobs:  # queued one at a time: admitted, and given slots, in this order
        tasks.append(asyncio.create_task(gen.generate_all(prompt, params)))
        while gen.stats()["num_waiting"] < len(tasks):
            await asyncio.sleep(0.005)
    await gen.resume()
    outs = await asyncio.gather(*tasks)
    return outs[1].samples[0].token_ids, outs[3].samples[0].token_ids


def _later_slots_check(setup, adapters, **config) -> None:
    prompt = setup.encode(text("Count with me: one, two,"))
    first_dir, first = adapters["first"]
    gen = setup.generator(max_running_prompts=4, max_loras=1, max_lora_rank=8, **config)
    try:
        base, adapted = run(_in_later_slots(gen, prompt, first_dir))
    finally:
        gen.shutdown()
    assert base == setup.reference(prompt, GREEDY.max_tokens)
    assert adapted == _reference(first, prompt, GREEDY.max_tokens) != base


@pytest.mark.parametrize("graphs", ["off", "static"])
def test_requests_in_later_slots_decode_with_their_own_adapter(setups, adapters, graphs):
    """The graph step computes row i for slot i; the adapter mask must follow it ("static" is
    that step run uncaptured, as on CPU)."""
    _later_slots_check(setups(FAMILY), adapters, decode_graphs=graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_requests_in_later_slots_decode_with_their_own_adapter_on_cuda(tiny_path, adapters):
    """The default CUDA settings (captured graphs) against graphs off, on the GPU."""
    from tests.engine.generating import Setup

    setup = Setup(tiny_path(FAMILY))
    setup.model.cuda()
    prompt = setup.encode(text("Count with me: one, two,"))
    outs = {}
    for graphs in ("auto", "off"):
        gen = setup.generator(max_running_prompts=4, max_loras=1, max_lora_rank=8,
                              decode_graphs=graphs)  # fmt: skip
        try:
            assert (gen.core.executor.runner.graphs is not None) == (graphs == "auto")
            outs[graphs] = run(_in_later_slots(gen, prompt, adapters["first"][0]))
        finally:
            gen.shutdown()
    assert outs["auto"] == outs["off"]
    assert outs["off"][1] != outs["off"][0]


def test_an_update_in_place_and_the_policy_default(setups, adapters):
    """A weight sync's LoraWeights become the default adapter; a later sync replaces them."""
    setup = setups(FAMILY)
    prompt = setup.encode(text("Count with me: one, two,"))
    first_dir, first = adapters["first"]
    second_dir, second = adapters["second"]
    base = setup.reference(prompt, GREEDY.max_tokens)
    gen = setup.generator(max_loras=1, max_lora_rank=8)

    async def main():
        await gen.update_weights(LoraWeights.from_dir(first_dir), version=1)
        a = (await gen.generate_all(prompt, GREEDY)).samples[0].token_ids
        await gen.update_weights(LoraWeights.from_dir(second_dir), version=2)
        b = (await gen.generate_all(prompt, GREEDY)).samples[0].token_ids
        return a, b, gen.policy_version

    try:
        a, b, version = run(main())
    finally:
        gen.shutdown()
    assert a == _reference(first, prompt, GREEDY.max_tokens)
    assert b == _reference(second, prompt, GREEDY.max_tokens)
    assert version == 2
    # the engine's adapters left with it: the shared model's own forward is the base again
    assert setup.reference(prompt, GREEDY.max_tokens) == base != a


def test_adapters_that_do_not_fit_are_refused(setups, adapters):
    setup = setups(FAMILY)
    gen = setup.generator(max_loras=1, max_lora_rank=4)
    prompt = setup.encode(text("Hi"))

    async def main():
        with pytest.raises(LoraError, match="rank 8, above the engine's max_lora_rank 4"):
            await gen.load_adapter("second", adapters["second"][0])
        await gen.load_adapter("first", adapters["first"][0])
        with pytest.raises(LoraError, match="at most 1 adapters"):
            await gen.load_adapter("third", adapters["first"][0])
        with pytest.raises(LoraError, match="no adapter named 'missing'"):
            await gen.generate_all(prompt, dataclasses.replace(GREEDY, adapter="missing"))
        # the engine still serves
        return await gen.generate_all(prompt, dataclasses.replace(GREEDY, adapter="first"))

    try:
        out = run(main())
    finally:
        gen.shutdown()
    assert out.samples[0].token_ids
    plain = setup.generator()
    try:
        with pytest.raises(LoraError, match="holds no LoRA adapters"):
            run(plain.generate_all(prompt, dataclasses.replace(GREEDY, adapter="first")))
    finally:
        plain.shutdown()


def test_a_directory_that_is_not_an_adapter_is_refused(tmp_path):
    with pytest.raises(LoraError, match="adapter_config.json is missing"):
        LoraWeights.from_dir(tmp_path)
