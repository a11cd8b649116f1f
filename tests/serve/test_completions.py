"""Completions responses and stream chunks built from prompts, scores and engine outputs: prompt
encoding and its 400s, choice indexing over a batch, echo, the logprobs shape, usage; read back
by the official `openai` types (no server needed: these are pure functions)."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from transformers import AutoTokenizer

from areno.engine.outputs import RequestOutput, SampleDelta, TokenScores
from areno.errors import PromptTooLongError
from areno.processing.encode import PromptLimits
from areno.protocol import RequestValidationError, parse_completion_request
from areno.serve.completions import (
    CompletionChunkWriter,
    PreparedCompletion,
    build_completion_response,
    encode_prompts,
)
from areno.serve.sampling import completion_sampling_params

LIMITS = PromptLimits(max_prompt_tokens=64, max_context_len=128)


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path("gemma4"))


def prepare(tokenizer, **body) -> PreparedCompletion:
    request = parse_completion_request(body)
    prompts = encode_prompts(request, tokenizer, LIMITS)
    return PreparedCompletion(request, completion_sampling_params(request), prompts)


def finished(deltas: list[SampleDelta]) -> RequestOutput:
    return RequestOutput("r", deltas, finished=True)


def test_text_prompts_are_tokenized_without_a_template(tokenizer):
    prepared = prepare(tokenizer, prompt=["Once upon", "a time"])
    for prompt, text in zip(prepared.prompts, ["Once upon", "a time"], strict=True):
        assert prompt.inputs.input_ids == tokenizer(text)["input_ids"]
        assert prompt.text == text and prompt.inputs.mm_inputs == {}


def test_token_prompts_run_as_given_and_echo_their_decoded_text(tokenizer):
    ids = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    [prompt] = prepare(tokenizer, prompt=ids).prompts
    assert prompt.inputs.input_ids == ids and prompt.text == "Hello world"


@pytest.mark.parametrize(
    ("prompt", "param"),
    [([5, 10**6], "prompt[1]"), ([[5], [6, 10**6]], "prompt[1][1]")],
)
def test_token_ids_outside_the_vocabulary_are_400(tokenizer, prompt, param):
    with pytest.raises(RequestValidationError) as caught:
        prepare(tokenizer, prompt=prompt)
    assert caught.value.param == param
    assert f"token id {10**6} is not in the vocabulary" in caught.value.message


def test_over_long_prompts_get_the_chat_endpoints_400(tokenizer):
    with pytest.raises(PromptTooLongError, match="--max-prompt-tokens=64") as caught:
        prepare(tokenizer, prompt=[[1], [1] * 65])
    assert caught.value.param == "prompt[1]" and caught.value.status_code == 400
    with pytest.raises(PromptTooLongError, match="lower max_tokens to at most 78"):
        prepare(tokenizer, prompt=[1] * 50, max_tokens=100)


def test_a_batch_with_n_samples_is_indexed_prompt_major(tokenizer):
    prepared = prepare(tokenizer, prompt=[[1, 2], [3]], n=2, max_tokens=2)
    outputs = [
        finished([SampleDelta(j, [7, 8], text=f"p{i}s{j}", finish_reason="length") for j in (1, 0)])
        for i in range(2)
    ]
    response = build_completion_response(prepared, "m", [None, None], outputs, tokenizer)
    parsed = Completion.model_validate(response.model_dump())
    assert sorted((c.index, c.text) for c in parsed.choices) == [
        (0, "p0s0"),
        (1, "p0s1"),
        (2, "p1s0"),
        (3, "p1s1"),
    ]
    assert parsed.usage.prompt_tokens == 3  # each prompt once, not once per sample
    assert parsed.usage.completion_tokens == 8
    assert all(c.logprobs is None for c in parsed.choices)


def test_echo_with_logprobs_puts_the_prompt_first(tokenizer):
    prepared = prepare(tokenizer, prompt="Hi there", echo=True, logprobs=1, max_tokens=1)
    ids = prepared.prompts[0].inputs.input_ids
    num_prompt = len(ids)
    score = TokenScores([-1.0 - i for i in range(num_prompt - 1)], [[(9, -0.5)]] * (num_prompt - 1))
    delta = SampleDelta(0, [11], text="!", logprobs=[-0.25], top_logprobs=[[(11, -0.25)]])
    delta.finish_reason = "length"
    response = build_completion_response(prepared, "m", [score], [finished([delta])], tokenizer)
    [choice] = response.choices
    assert choice.text == "Hi there!" and choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in [*ids, 11]]
    assert logprobs.token_logprobs == [None, *score.logprobs, -0.25]
    assert logprobs.top_logprobs[0] is None
    assert logprobs.top_logprobs[1:] == [{tokenizer.decode([9]): -0.5}] * (num_prompt - 1) + [
        {tokenizer.decode([11]): -0.25}
    ]
    # Offsets into the choice's text: the prompt's tokens from 0, the sample's after the prompt.
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[-1] == len("Hi there")
    assert response.usage.completion_tokens == 1


def test_scoring_only_echoes_the_prompt_and_generates_nothing(tokenizer):
    prepared = prepare(tokenizer, prompt=[[5, 6, 7]], echo=True, logprobs=0, max_tokens=0, n=2)
    assert prepared.params is None and prepared.scores_prompts
    score = TokenScores([-1.5, -2.5])
    response = build_completion_response(prepared, "m", [score], [None], tokenizer)
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        assert choice.text == tokenizer.decode([5, 6, 7]) and choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs == [None, -1.5, -2.5]
        assert choice.logprobs.top_logprobs == [None, {}, {}]
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (3, 0)


def stream_lines(writer: CompletionChunkWriter, steps: list[tuple[int, RequestOutput]]):
    lines = list(writer.start())
    for i, output in steps:
        lines += writer.chunks(i, output)
    return lines + list(writer.end())


def test_a_stream_carries_the_echo_the_deltas_and_the_usage(tokenizer):
    prepared = prepare(
        tokenizer,
        prompt=["A", "B"],
        echo=True,
        logprobs=0,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    scores = [TokenScores([-1.0] * (p.inputs.num_prompt_tokens - 1)) for p in prepared.prompts]
    writer = CompletionChunkWriter(prepared, "m", scores, tokenizer)
    steps = [
        (1, RequestOutput("r-1", [SampleDelta(0, [7], text="x", logprobs=[-0.5])])),
        (0, RequestOutput("r-0", [SampleDelta(0, [8], text="y", logprobs=[-0.5])])),
        (0, finished([SampleDelta(0, [9], text="z", logprobs=[-0.1], finish_reason="length")])),
        (1, finished([SampleDelta(0, [], finish_reason="stop")])),
    ]
    lines = stream_lines(writer, steps)
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    texts, finish, offsets = {}, {}, []
    for chunk in chunks[:-1]:
        assert chunk["usage"] is None
        for choice in chunk["choices"]:
            i = choice["index"]
            texts[i] = texts.get(i, "") + choice["text"]
            finish[i] = choice["finish_reason"] or finish.get(i)
            offsets += choice["logprobs"]["text_offset"] if i == 0 else []
    assert texts == {0: "Ayz", 1: "Bx"} and finish == {0: "length", 1: "stop"}
    assert offsets[-2:] == [1, 2]  # the samples' tokens start after the echoed "A"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert writer.summary()["choices"] == [
        {"index": 0, "text": "Ayz", "finish_reason": "length"},
        {"index": 1, "text": "Bx", "finish_reason": "stop"},
    ]
