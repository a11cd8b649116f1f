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
from areno.serve.openai_routes import ChunkWriter, build_response, tools_in_play
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
