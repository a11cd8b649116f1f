"""Responses and stream chunks built from engine outputs, tool calls included, read back by the
official `openai` types (no server needed: these are pure functions)."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChunk
from transformers import AutoTokenizer

from areno.engine.outputs import RequestOutput, SampleDelta
from areno.processing.types import PromptInputs
from areno.protocol import parse_chat_request
from areno.serve.openai_routes import (
    ChunkWriter,
    build_response,
    forced_prompt_text,
    forced_reply_prefix,
    tools_in_play,
)
from areno.tools import get_tool_parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL_TEXT = {
    "qwen3_xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>",
    "hermes_json": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>",
    "gemma4": '<|tool_call>call:get_weather{"city": "Paris"}<tool_call|>',
}


def request(**extra):
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS} | extra
    return parse_chat_request(body)


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path("qwen3_5"))


def output(text: str, finish: str = "stop") -> RequestOutput:
    delta = SampleDelta(0, [1, 2], text=text, finish_reason=finish)
    return RequestOutput("r", [delta], num_prompt_tokens=5, finished=True)


@pytest.mark.parametrize("tool_format", sorted(CALL_TEXT))
def test_response_splits_tool_calls(tokenizer, tool_format):
    parser = get_tool_parser(tool_format)
    chat = request()
    text = "Let me check. " + CALL_TEXT[tool_format]
    body = build_response(chat, "m", PromptInputs([1] * 5, {}), output(text), tokenizer, parser)
    parsed = ChatCompletion.model_validate(body.model_dump(exclude_none=True))
    choice = parsed.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("tool_format", sorted(CALL_TEXT))
def test_stream_splits_tool_calls_across_deltas(tokenizer, tool_format):
    parser = get_tool_parser(tool_format)
    chat = request(stream=True)
    writer = ChunkWriter(chat, "m", PromptInputs([1] * 5, {}), tokenizer, parser)
    text = "Checking. " + CALL_TEXT[tool_format]
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    lines = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = SampleDelta(0, [7], text=piece, finish_reason="stop" if last else None)
        lines += writer.chunks(RequestOutput("r", [delta], finished=last))
    lines += writer.end()
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [OpenAIChunk.model_validate_json(line[6:]) for line in lines[:-1]]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert content == "Checking."
    assert calls[0].function.name == "get_weather" and calls[0].id
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_malformed_call_text_comes_back_as_content(tokenizer):
    parser = get_tool_parser("hermes_json")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    body = build_response(
        request(), "m", PromptInputs([1] * 5, {}), output(text), tokenizer, parser
    )
    assert body.choices[0].message.content == text
    assert body.choices[0].message.tool_calls == []
    assert body.choices[0].finish_reason == "stop"


def test_tool_choice_none_keeps_tools_out_of_play():
    assert tools_in_play(request())
    assert not tools_in_play(request(tool_choice="none"))
    assert not tools_in_play(parse_chat_request({"messages": [{"role": "user", "content": "x"}]}))


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_forced_prefix_follows_tool_choice():
    parser = get_tool_parser("hermes_json")
    assert forced_reply_prefix(request(), parser) == ""
    assert forced_reply_prefix(request(tool_choice="auto"), parser) == ""
    assert forced_reply_prefix(request(tool_choice="none"), parser) == ""
    assert forced_reply_prefix(request(tool_choice="required"), None) == ""
    assert forced_reply_prefix(request(tool_choice="required"), parser) == (
        parser.forced_prefix(None)
    )
    assert forced_reply_prefix(request(tool_choice=NAMED), parser) == (
        parser.forced_prefix("get_weather")
    )


def test_forced_call_closes_an_open_reasoning_block():
    assert forced_prompt_text("<|im_start|>assistant\n", "<tool_call>") == "<tool_call>"
    thinking = "<|im_start|>assistant\n<think>\n"
    assert forced_prompt_text(thinking, "<tool_call>") == "\n</think>\n\n<tool_call>"
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert forced_prompt_text(closed, "<tool_call>") == "<tool_call>"


def _forced_split(tool_format: str) -> tuple[str, str]:
    """The named-choice prefix of a format and the generated rest of CALL_TEXT after it."""
    prefix = get_tool_parser(tool_format).forced_prefix("get_weather")
    text = CALL_TEXT[tool_format]
    assert text.startswith(prefix)
    return prefix, text[len(prefix) :]


@pytest.mark.parametrize("tool_format", sorted(CALL_TEXT))
def test_forced_call_response_names_the_function(tokenizer, tool_format):
    """The engine generates only what follows the forced prefix; the response still holds the
    whole call."""
    parser = get_tool_parser(tool_format)
    prefix, generated = _forced_split(tool_format)
    chat = request(tool_choice=NAMED)
    inputs = PromptInputs([1] * 5, {})
    body = build_response(chat, "m", inputs, output(generated), tokenizer, parser, prefix)
    choice = ChatCompletion.model_validate(body.model_dump(exclude_none=True)).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )


@pytest.mark.parametrize("tool_format", sorted(CALL_TEXT))
def test_forced_call_streams_with_its_name(tokenizer, tool_format):
    parser = get_tool_parser(tool_format)
    prefix, generated = _forced_split(tool_format)
    chat = request(tool_choice=NAMED, stream=True, n=2)
    writer = ChunkWriter(chat, "m", PromptInputs([1] * 5, {}), tokenizer, parser, prefix)
    lines = []
    for i, char in enumerate(generated):
        last = i == len(generated) - 1
        deltas = [
            SampleDelta(k, [7], text=char, finish_reason="stop" if last else None) for k in (0, 1)
        ]
        lines += writer.chunks(RequestOutput("r", deltas, finished=last))
    chunks = [OpenAIChunk.model_validate_json(line[6:]) for line in lines]
    for index in (0, 1):
        choices = [c for chunk in chunks for c in chunk.choices if c.index == index]
        calls = [tc for c in choices for tc in c.delta.tool_calls or []]
        assert calls[0].function.name == "get_weather"
        assert "".join(c.delta.content or "" for c in choices) == ""
        assert choices[-1].finish_reason == "tool_calls"
    assert writer.num_malformed_tool_calls == 0


def test_unfinished_forced_call_is_content_with_its_prefix(tokenizer):
    parser = get_tool_parser("gemma4")
    prefix = parser.forced_prefix("get_weather")
    chat = request(tool_choice=NAMED)
    body = build_response(
        chat, "m", PromptInputs([1] * 5, {}), output("{zq", "length"), tokenizer, parser, prefix
    )
    assert body.choices[0].message.content == prefix + "{zq"
    assert not body.choices[0].message.tool_calls
    assert body.choices[0].finish_reason == "length"
