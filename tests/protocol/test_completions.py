"""The Completions request (`parse_completion_request`): every prompt form, the field rules, the
refused and unknown fields named in the 400, and the response types read back by the official
`openai` types."""

from __future__ import annotations

import pytest
from openai.types import Completion

from areno.protocol import (
    REFUSED_FIELDS,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ErrorResponse,
    RequestValidationError,
    Usage,
    parse_completion_request,
)
from areno.protocol import completions as completions_module


def error_of(body) -> RequestValidationError:
    with pytest.raises(RequestValidationError) as info:
        parse_completion_request(body)
    assert info.value.status_code == 400
    return info.value


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("Once upon", ["Once upon"]),
        (["a", "b c"], ["a", "b c"]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5], [6, 7]], [[5], [6, 7]]),
        ("", [""]),  # tokenizes to what the tokenizer adds; the server decides
    ],
)
def test_every_prompt_form_reads_as_a_batch(prompt, prompts):
    request = parse_completion_request({"model": "m", "prompt": prompt, "n": 2})
    assert request.prompts == prompts
    assert request.num_choices == 2 * len(prompts)


def test_defaults_are_openais():
    request = parse_completion_request(b'{"prompt": "hi", "max_tokens": null, "n": null}')
    assert (request.max_tokens, request.n, request.echo, request.logprobs) == (16, 1, False, None)
    assert request.stop_sequences == [] and not request.include_usage


def test_an_evaluation_harness_scoring_request_parses():
    """What lm-eval's `local-completions` sends to score a batch of token-id prompts."""
    body = {
        "model": "m",
        "prompt": [[1, 2, 3], [4, 5]],
        "temperature": 0,
        "max_tokens": 0,
        "logprobs": 2,
        "seed": 1234,
        "echo": True,
    }
    request = parse_completion_request(body)
    assert request.prompts == [[1, 2, 3], [4, 5]] and request.logprobs == 2


@pytest.mark.parametrize(
    ("prompt", "param", "needle"),
    [
        ([], "prompt", "must not be empty"),
        ([[]], "prompt[0]", "at least 1 item"),
        ([1, "a"], "prompt[1]", "valid integer"),
        (["a", 1], "prompt[1]", "valid string"),
        ([[1, -2]], "prompt[0][1]", "greater than or equal to 0"),
        ([1.5], "prompt", "an array of token ids"),
        ([True], "prompt", "an array of token ids"),
        ({"text": "hi"}, "prompt", "a string, an array of strings"),
    ],
)
def test_a_bad_prompt_is_named_by_its_path(prompt, param, needle):
    error = error_of({"prompt": prompt})
    assert error.param == param and needle in error.message


def test_a_batch_over_the_limit_is_refused(monkeypatch):
    monkeypatch.setattr(completions_module, "MAX_PROMPTS", 3)
    assert len(parse_completion_request({"prompt": [[1]] * 3}).prompts) == 3
    for prompt in ([[1]] * 4, ["a"] * 4):
        error = error_of({"prompt": prompt})
        assert error.param == "prompt" and "4 prompts exceed the limit of 3" in error.message
    # One prompt of many tokens is not a batch.
    assert parse_completion_request({"prompt": [1] * 10}).prompts == [[1] * 10]


@pytest.mark.parametrize("name", REFUSED_FIELDS)
def test_each_refused_field_is_named(name):
    error = error_of({"prompt": "hi", name: {"x": 1} if name.endswith("_bias") else 1})
    assert error.param == name and "not supported" in error.message
    body = ErrorResponse.from_error(error).model_dump()
    assert body["error"]["param"] == name and body["error"]["type"] == "invalid_request_error"
    # null is "not set"
    assert parse_completion_request({"prompt": "hi", name: None}).prompts == ["hi"]


def test_every_refused_and_unknown_field_is_listed():
    error = error_of({"prompt": "hi", "suffix": "!", "echo": True})
    assert [e.path for e in error.errors] == ["suffix"]
    error = error_of({"prompt": "hi", "frobnicate": 1, "max_new_tokens": 4})
    assert error.param == "frobnicate"
    assert [e.path for e in error.errors] == ["frobnicate", "max_new_tokens"]
    assert "Unknown field" in error.message


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"max_tokens": 0}, "max_tokens", "requires 'echo': true"),
        ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
        ({"best_of": 3}, "best_of", "must equal n (1)"),
        ({"n": 2, "best_of": 3}, "best_of", "must equal n (2)"),
        ({"logprobs": True}, "logprobs", "valid integer"),
        ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"logprobs": -1}, "logprobs", "greater than or equal to 0"),
        ({"top_k": 0}, "top_k", "-1 (disabled) or at least 1"),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"n": 17}, "n", "less than or equal to 16"),
        ({"stop": ""}, "stop", "at least 1 character"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "'stream': true"),
    ],
)
def test_field_rules_name_the_field(fields, param, needle):
    error = error_of({"prompt": "hi", **fields})
    assert error.param == param and needle in error.message, error.message


def test_the_accepted_forms_of_the_rules():
    request = parse_completion_request(
        {"prompt": "hi", "max_tokens": 0, "echo": True, "n": 2, "best_of": 2, "logprobs": 0}
    )
    assert (request.max_tokens, request.best_of, request.logprobs) == (0, 2, 0)
    request = parse_completion_request(
        {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}, "stop": "x"}
    )
    assert request.include_usage and request.stop_sequences == ["x"]


def test_responses_read_back_as_openai_completions():
    logprobs = CompletionLogprobs(
        tokens=["Hi", " there"],
        token_logprobs=[-0.5, -1.25],
        top_logprobs=[{"Hi": -0.5, "Yo": -2.0}, {" there": -1.25}],
        text_offset=[0, 2],
    )
    response = CompletionResponse(
        model="m",
        choices=[
            CompletionChoice(index=0, text="Hi there", logprobs=logprobs, finish_reason="stop")
        ],
        usage=Usage.from_counts(3, 2),
    )
    parsed = Completion.model_validate(response.model_dump())
    assert parsed.object == "text_completion" and parsed.id.startswith("cmpl-")
    assert parsed.choices[0].logprobs.top_logprobs[0] == {"Hi": -0.5, "Yo": -2.0}
    assert parsed.usage.total_tokens == 5
