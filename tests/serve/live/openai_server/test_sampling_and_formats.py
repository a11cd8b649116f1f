"""Sampling fields and output formats on the open Gemma 4 app: a json_schema reply that validates,
logit_bias and frequency_penalty with visible effects, and fields that would be silently ignored
refused by name."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serve.live.apps import PET_SCHEMA
from tests.serve.live.openai_server.client import ask


def test_a_json_schema_reply_validates_against_the_schema(server):
    """Random weights: only the grammar makes these replies parse."""

    format_ = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    response = ask(server, "Name a pet.", response_format=format_, n=2, temperature=1.0, seed=2,
                   max_tokens=48)  # fmt: skip
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content), PET_SCHEMA)
        assert choice.finish_reason == "stop"


def test_logit_bias_of_100_makes_every_token_that_token(server, tokenizer):
    token_id = tokenizer.encode("a", add_special_tokens=False)[0]
    response = ask(server, "Hello.", logit_bias={str(token_id): 100}, temperature=1.0, seed=1,
                   max_tokens=6, logprobs=True)  # fmt: skip
    tokens = [t.token for t in response.choices[0].logprobs.content]
    assert tokens == [tokenizer.decode([token_id])] * 6
    # Logprobs stay the model's own: the bias does not make the token certain.
    assert all(t.logprob < 0 for t in response.choices[0].logprobs.content)


def test_a_frequency_penalty_removes_repeats_from_a_greedy_reply(server):
    def tokens(**kwargs):
        """The reply's tokens as text, less the byte tokens of partial characters (each
        decodes to U+FFFD alone, so distinct ids would compare equal)."""
        response = ask(server, "Tell me a story.", max_tokens=40, logprobs=True,
                       extra_body={"ignore_eos": True}, **kwargs)  # fmt: skip
        return [t.token for t in response.choices[0].logprobs.content if t.token != "\ufffd"]

    greedy = tokens()
    penalised = tokens(frequency_penalty=2.0)
    assert len(set(greedy)) < len(greedy), "the plain greedy reply repeats itself"
    assert len(set(penalised)) == len(penalised)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("store", True),
        ("reasoning_effort", "high"),
        ("functions", [{"name": "f"}]),
        ("no_such_field", 1),
        ("logit_bias", {"x": 1}),
    ],
)
def test_fields_that_would_be_ignored_are_refused_by_name(server, field, value):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(server, "Hi.", extra_body={field: value})
    assert caught.value.body["param"] == field and field in caught.value.message
    assert ask(server, "Hi.").choices[0].finish_reason in {"stop", "length"}
