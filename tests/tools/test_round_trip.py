"""Each family's own chat template renders assistant tool calls; its parser must read them back."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from areno.models import get_adapter
from areno.tools import get_tool_parser
from tests.tools.helpers import assert_stream_matches_parse

FAMILIES = ("qwen3_5", "qwen3_vl", "minicpmv4_6", "gemma4")
EXPECTED_FORMAT = {
    "qwen3_5": "qwen3_xml",
    "qwen3_vl": "hermes_json",
    "minicpmv4_6": "hermes_json",
    "gemma4": "gemma4",
}
ASSISTANT_HEADER = {
    "qwen3_5": "<|im_start|>assistant\n",
    "qwen3_vl": "<|im_start|>assistant\n",
    "minicpmv4_6": "<|im_start|>assistant\n",
    "gemma4": "<|turn>model\n",
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "zip": {"type": "string"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "filter": {"type": "object"},
                    "ids": {"type": "array", "items": {"type": "integer"}},
                    "exact": {"type": "boolean"},
                    "limit": {"type": "number"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    },
]
WEATHER = (
    "get_weather",
    # "zip" looks like a number; its schema type keeps it a string in the XML format.
    {"city": 'Pa"ris\nNord – 東京 🌧', "days": 3, "zip": "75001"},
)
SEARCH = (
    "search",
    {
        "query": 'say "hi"\n\tthen <b>bye</b> \\ done',
        "filter": {"tags": ["a", 'b"c'], "range": {"lo": -1.5, "hi": 2000.0}, "deep": [[1, {}]]},
        "ids": [1, 2, 3],
        "exact": True,
        "limit": 0.25,
        "note": None,
    },
)
EMPTY_STRING = ("get_weather", {"city": "", "days": -7})
CASES = {
    "one_call": ("Let me look that up.", [WEATHER]),
    "two_calls": ("", [SEARCH, EMPTY_STRING]),
    "two_calls_with_content": ("Two lookups:\nfirst the search.", [SEARCH, WEATHER]),
}


@pytest.fixture(scope="module")
def tokenizers(tiny_path):
    return {family: AutoTokenizer.from_pretrained(tiny_path(family)) for family in FAMILIES}


def render_assistant_turn(tokenizer, family: str, content: str, calls) -> str:
    """The assistant turn's text as the template writes it, between header and end of turn."""
    tool_calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(calls)
    ]
    messages = [
        {"role": "user", "content": "What should I do?"},
        {"role": "assistant", "content": content, "tool_calls": tool_calls},
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    header = ASSISTANT_HEADER[family]
    start = rendered.rindex(header) + len(header)
    return rendered[start : rendered.index(get_adapter(family).stop_tokens[0], start)]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_uses_expected_format(family):
    assert get_adapter(family).tool_format == EXPECTED_FORMAT[family]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("family", FAMILIES)
def test_render_then_parse(tokenizers, family, case):
    content, calls = CASES[case]
    text = render_assistant_turn(tokenizers[family], family, content, calls)
    parser = get_tool_parser(get_adapter(family).tool_format)

    parsed = parser.parse(text, TOOLS)

    assert parsed.content == content
    assert parsed.num_malformed == 0
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        (name, args) for name, args in calls
    ]
    assert all(c.type == "function" and c.id.startswith("call_") for c in parsed.tool_calls)
    assert len({c.id for c in parsed.tool_calls}) == len(calls)
    assert_stream_matches_parse(parser, text, TOOLS)


@pytest.mark.parametrize("family", FAMILIES)
def test_truncated_generation_is_content_at_every_cut(tokenizers, family):
    """A generation stopped anywhere inside the call (max_tokens) is content, verbatim."""
    content, calls = CASES["one_call"]
    text = render_assistant_turn(tokenizers[family], family, content, calls)
    parser = get_tool_parser(get_adapter(family).tool_format)
    call_start = text.index(parser.start_tag)
    for cut in range(call_start + 1, len(text) - 1):
        parsed = parser.parse(text[:cut], TOOLS)
        assert (parsed.content, parsed.tool_calls) == (text[:cut], [])
        assert parsed.num_malformed == int(cut >= call_start + len(parser.start_tag))
