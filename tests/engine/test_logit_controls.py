"""What changes the drawn token besides the distribution's own filters: logit_bias, presence /
frequency / repetition penalties, min_tokens and grammars, in a real engine on tiny random
checkpoints (random weights: only the control can make these outcomes happen).

Each is checked against a reference computed here from the model's own logits, and batched
next to rows without controls, which must stay exactly as they were."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from areno.engine.outputs.grammar import GrammarError
from areno.engine.sampling import SamplingParams, StructuredOutput
from areno.errors import ConfigError
from tests.engine.generating import run, text

FAMILY = "qwen3_5"
PROMPT = "Count the colors of the rainbow, one by one, and then once more."


@pytest.fixture(scope="module")
def setup(setups):
    return setups(FAMILY)


@pytest.fixture(scope="module", params=["off", "on"], ids=["steps", "overlapped"])
def generator(request, setup):
    gen = setup.generator(overlap_steps=request.param)
    yield gen
    gen.shutdown()


def together(gen, jobs):
    """(inputs, params) requests started in one engine step; their outputs."""

    async def main():
        await gen.pause("keep")
        tasks = [asyncio.create_task(gen.generate_all(x, p)) for x, p in jobs]
        while gen.stats()["num_waiting"] < len(jobs):
            await asyncio.sleep(0.005)
        await gen.resume()
        return await asyncio.gather(*tasks)

    return run(main())


def greedy_penalised_reference(
    setup, inputs, steps, *, frequency=0.0, presence=0.0, repetition=1.0
):
    """Greedy decoding with the penalties applied to full-forward logits, step by step: the
    repetition penalty over prompt and output tokens, then OpenAI's over output tokens."""
    model = setup.model
    ids = list(inputs.input_ids)
    counts: dict[int, int] = {}
    out = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        for token in set(ids):
            value = logits[token]
            logits[token] = value / repetition if value > 0 else value * repetition
        for token, count in counts.items():
            logits[token] -= frequency * count + presence
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        counts[token] = counts.get(token, 0) + 1
    return out


def test_logit_bias_makes_every_token_the_biased_one_and_leaves_logprobs_raw(setup, generator):
    inputs = setup.encode(text(PROMPT))
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    target = 37
    biased = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=6,
        ignore_eos=True,
        logprobs=True,
        logit_bias={target: 100.0},
    )
    base, out = together(generator, [(inputs, plain), (inputs, biased)])
    assert out.samples[0].token_ids == [target] * 6
    assert base.samples[0].token_ids != [target] * 6  # the unbiased row in the batch is untouched
    # Reported logprobs are the model's: the biased token is not certain under them.
    assert all(lp < -0.01 for lp in out.samples[0].logprobs)


def test_frequency_and_presence_penalties_equal_the_reference(setup, generator):
    inputs = setup.encode(text(PROMPT))
    steps = 48
    plain = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    penalised = SamplingParams(
        temperature=0,
        max_tokens=steps,
        ignore_eos=True,
        frequency_penalty=1.5,
        presence_penalty=0.5,
    )
    base, out = together(generator, [(inputs, plain), (inputs, penalised)])
    expected = greedy_penalised_reference(setup, inputs, steps, frequency=1.5, presence=0.5)
    assert out.samples[0].token_ids == expected
    greedy = base.samples[0].token_ids
    assert len(set(greedy)) < len(greedy), "the unpenalised greedy reply repeats tokens"
    assert len(set(expected)) > len(set(greedy))


def test_repetition_penalty_reaches_prompt_tokens(setup, generator):
    inputs = setup.encode(text(PROMPT))
    plain = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    strict = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, repetition_penalty=4.0)
    base, out = (
        o.samples[0].token_ids for o in together(generator, [(inputs, plain), (inputs, strict)])
    )
    assert out == greedy_penalised_reference(setup, inputs, 48, repetition=4.0)
    assert out != base


def test_min_tokens_keeps_eos_and_stop_tokens_away(setup, generator):
    inputs = setup.encode(text(PROMPT))
    eos = sorted(generator.core.eos_token_ids)
    # A bias makes EOS the likeliest token; min_tokens must still hold it off for 5 tokens.
    params = SamplingParams(
        temperature=0,
        max_tokens=20,
        min_tokens=5,
        logit_bias={eos[0]: 50.0},
        stop_token_ids=[eos[0]],
    )
    out = run(generator.generate_all(inputs, params)).samples[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos[0]
    assert out.finish_reason == "stop"


SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "done": {"type": "boolean"},
    },
    "required": ["color", "count", "done"],
    "additionalProperties": False,
}


def test_a_json_schema_grammar_gives_parsable_objects_beside_free_rows(setup, generator):
    inputs = setup.encode(text(PROMPT))
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA), param="response_format")
    structured = SamplingParams(temperature=1.0, seed=7, max_tokens=64, n=3, structured=spec)
    free = SamplingParams(temperature=0, max_tokens=12)
    *outs, base = together(generator, [(inputs, structured), (inputs, structured), (inputs, free)])
    for output in outs:
        for sample in output.samples:
            value = json.loads(sample.text)
            assert set(value) == {"color", "count", "done"} and value["color"] in {
                "red",
                "green",
                "blue",
            }
            assert 0 <= value["count"] <= 9 and isinstance(value["done"], bool)
            assert sample.finish_reason == "stop"
    assert base.samples[0].token_ids == setup.reference(inputs, 12)


def test_a_grammar_that_does_not_compile_is_refused_and_the_engine_serves_on(setup, generator):
    inputs = setup.encode(text(PROMPT))
    bad = StructuredOutput(
        "json_schema", '{"type": "object", "properties": ', param="response_format"
    )
    with pytest.raises(GrammarError) as caught:
        run(generator.generate_all(inputs, SamplingParams(max_tokens=4, structured=bad)))
    assert caught.value.param == "response_format"
    with pytest.raises(ConfigError) as caught:
        run(generator.generate_all(inputs, SamplingParams(max_tokens=4, logit_bias={10**7: 1.0})))
    assert caught.value.param == "logit_bias"
    out = run(generator.generate_all(inputs, SamplingParams(temperature=0, max_tokens=4)))
    assert len(out.samples[0].token_ids) == 4
