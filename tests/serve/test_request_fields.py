"""Every field of the Chat Completions request does something, or is refused by name.

The schema's fields are enumerated: each must appear in exactly one table below, so a field
added to `ChatCompletionRequest` without an effect (or a refusal) fails here.
- EFFECTS: setting the field changes what the server derives from the request (the encoded
  prompt, the engine's SamplingParams, the prepared grammar), checked against the same request
  without it.
- LIVE: the effect shows only on the wire (streaming, the served model, the completion log); the
  named test of a live-server module asserts it.
- UNSUPPORTED_FIELDS: OpenAI fields AReno does not implement: a 400 naming the field unless the
  value asks for nothing.
"""

from __future__ import annotations

import importlib
import json

import pytest

from areno.models.registry import adapter_for_checkpoint
from areno.processing import Processor
from areno.protocol import ChatCompletionRequest, RequestValidationError, parse_chat_request
from areno.protocol.chat import UNSUPPORTED_FIELDS
from areno.serve.chat import prepare, tools_in_play
from areno.serve.sampling import sampling_params
from areno.tools import get_tool_parser

BASE = {"messages": [{"role": "user", "content": "Hello."}]}
TOOL = {"type": "function", "function": {"name": "zoom", "parameters": {"type": "object"}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _params(field):
    return lambda prepared: getattr(prepared.params, field)


def _prompt(prepared):
    return prepared.inputs.input_ids


# field -> (the body's extra fields, what must differ from the same body without the field)
EFFECTS = {
    "messages": ({"messages": [{"role": "user", "content": "Bye."}]}, _prompt),
    "tools": ({"tools": [TOOL]}, _prompt),
    "tool_choice": ({"tools": [TOOL], "tool_choice": "required"}, _prompt),
    "parallel_tool_calls": (
        {"tools": [TOOL], "parallel_tool_calls": False},
        lambda p: p.params.structured,
    ),
    "temperature": ({"temperature": 0.5}, _params("temperature")),
    "top_p": ({"top_p": 0.5}, _params("top_p")),
    "top_k": ({"top_k": 5}, _params("top_k")),
    "min_p": ({"min_p": 0.1}, _params("min_p")),
    "presence_penalty": ({"presence_penalty": 0.5}, _params("presence_penalty")),
    "frequency_penalty": ({"frequency_penalty": 0.5}, _params("frequency_penalty")),
    "repetition_penalty": ({"repetition_penalty": 1.2}, _params("repetition_penalty")),
    "logit_bias": ({"logit_bias": {"7": 5}}, _params("logit_bias")),
    "seed": ({"seed": 3}, _params("seed")),
    "n": ({"n": 2}, _params("n")),
    "max_tokens": ({"max_tokens": 5}, _params("max_tokens")),
    "max_completion_tokens": ({"max_completion_tokens": 5}, _params("max_tokens")),
    "min_tokens": ({"min_tokens": 2}, _params("min_tokens")),
    "stop": ({"stop": ["x"]}, _params("stop")),
    "stop_token_ids": ({"stop_token_ids": [7]}, _params("stop_token_ids")),
    "ignore_eos": ({"ignore_eos": True}, _params("ignore_eos")),
    "logprobs": ({"logprobs": True}, _params("logprobs")),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, _params("top_logprobs")),
    "response_format": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA},
            }
        },
        lambda p: p.params.structured,
    ),
    "chat_template_kwargs": ({"chat_template_kwargs": {"enable_thinking": False}}, _prompt),
}
# field -> (module, test) that shows its effect on a live server
LIVE = {
    "model": (
        "tests.serve.live.openai_server.test_lora",
        "test_an_adapter_answers_as_the_merged_model_and_unlike_the_base",
    ),
    "stream": (
        "tests.serve.live.openai_server.test_chat_media",
        "test_streaming_matches_the_full_response",
    ),
    "stream_options": (
        "tests.serve.live.openai_server.test_chat_media",
        "test_streaming_matches_the_full_response",
    ),
    "user": (
        "tests.serve.live.openai_server.test_tools_and_logging",
        "test_completions_are_logged_with_areno_log_completions",
    ),
    "metadata": (
        "tests.serve.live.openai_server.test_tools_and_logging",
        "test_completions_are_logged_with_areno_log_completions",
    ),
    "return_token_ids": (
        "tests.serve.live.openai_server.test_sampling_and_formats",
        "test_return_token_ids_gives_the_engines_ids_whole_and_streamed",
    ),
}


def test_every_request_field_is_in_exactly_one_table():
    tables = [set(EFFECTS), set(LIVE), set(UNSUPPORTED_FIELDS)]
    assert set().union(*tables) == set(ChatCompletionRequest.model_fields)
    assert sum(map(len, tables)) == len(ChatCompletionRequest.model_fields)


@pytest.mark.parametrize("field", sorted(LIVE))
def test_live_effects_have_their_test(field):
    module, name = LIVE[field]
    assert callable(getattr(importlib.import_module(module), name))


@pytest.fixture(scope="module")
def server_side(tiny_path):
    """The pieces `prepare` needs, on the tiny Qwen3.5 (whose template reads enable_thinking)."""
    path = tiny_path("qwen3_5")
    processor = Processor(path)
    return processor, get_tool_parser(adapter_for_checkpoint(path).tool_format)


def _prepared(server_side, body):
    processor, parser = server_side
    request = parse_chat_request(json.dumps(body).encode())
    encoded = processor.encode(
        request.messages,
        [],
        tools=request.tools if tools_in_play(request) else None,
        chat_template_kwargs=request.chat_template_kwargs,
    )
    return prepare(request, sampling_params(request), encoded, parser, processor.tokenizer)


@pytest.mark.parametrize("field", sorted(EFFECTS))
def test_setting_a_field_changes_what_the_server_runs(server_side, field):
    extra, probe = EFFECTS[field]
    with_field = BASE | extra
    without = {k: v for k, v in with_field.items() if k != field} or BASE
    without = BASE | without
    if field == "messages":
        without = BASE
    assert probe(_prepared(server_side, with_field)) != probe(_prepared(server_side, without))


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_FIELDS))
def test_unsupported_fields_are_refused_by_name_unless_neutral(field):
    neutral, _ = UNSUPPORTED_FIELDS[field]
    parse_chat_request(json.dumps(BASE | {field: neutral}).encode())
    with pytest.raises(RequestValidationError) as caught:
        parse_chat_request(json.dumps(BASE | {field: "something"}).encode())
    assert caught.value.param == field and field in str(caught.value)


def test_an_unknown_field_is_refused_by_name():
    with pytest.raises(RequestValidationError) as caught:
        parse_chat_request(json.dumps(BASE | {"temprature": 0.5}).encode())
    assert caught.value.param == "temprature"


@pytest.mark.parametrize(
    "grammar",
    [
        {"response_format": {"type": "json_object"}},
        {"tools": [TOOL], "tool_choice": "required"},
        {"tools": [TOOL], "parallel_tool_calls": False},
    ],
    ids=["response_format", "tool_choice", "parallel_tool_calls"],
)
def test_min_tokens_under_a_grammar_is_refused_by_name(server_side, grammar):
    """A grammar ends the reply where its document ends, so a floor on the length is refused
    (a 400 naming min_tokens), not silently dropped; without a grammar it holds."""
    from areno.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        _prepared(server_side, BASE | grammar | {"min_tokens": 3})
    assert caught.value.param == "min_tokens" and "grammar" in str(caught.value)
    assert _prepared(server_side, BASE | {"tools": [TOOL], "min_tokens": 3}).params.min_tokens == 3
