"""LoRA adapters in the engine (areno/engine/lora.py) against `peft` on plain transformers: a
PEFT adapter directory loaded into the Generator gives peft's greedy tokens, base and adapter
requests in one batch each match their own reference, and adapters that do not fit are refused."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from areno.engine.lora import LoraError, LoraWeights
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
