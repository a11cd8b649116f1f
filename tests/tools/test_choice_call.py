"""`choice_call`: a forced call whose only freedom is one listed value. The server writes the
call around that value (`before`, `after`) and the model samples the value's telling part
alone, so for every family the whole call must be the one the template (or, for Gemma 4, the
constrained-call notation) writes, and parse back to that value."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from areno.models import get_adapter
from areno.tools import choice_call, get_tool_parser
from tests.tools.test_round_trip import ASSISTANT_HEADER, FAMILIES


def one_enum(values: list, key: str = "letter") -> dict:
    return {
        "type": "object",
        "properties": {key: {"type": "string", "enum": values}},
        "required": [key],
        "additionalProperties": False,
    }


LETTERS = one_enum(["A", "B", "C", "D"])
PICK = [{"type": "function", "function": {"name": "pick", "parameters": LETTERS}}]


def parser_of(family: str):
    return get_tool_parser(get_adapter(family).tool_format)


def rendered_call(tokenizer, family: str, value) -> str:
    """The template's assistant turn holding one call `pick(letter=value)`."""
    call = {"name": "pick", "arguments": {"letter": value}}
    messages = [
        {"role": "user", "content": "Which?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": call}]},
    ]
    text = tokenizer.apply_chat_template(messages, tools=PICK, tokenize=False)
    header = ASSISTANT_HEADER[family]
    start = text.rindex(header) + len(header)
    return text[start : text.index(get_adapter(family).stop_tokens[0], start)].strip()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_call_around_each_value_parses_to_that_value(family):
    parser = parser_of(family)
    choice = choice_call(parser, "pick", LETTERS)
    assert choice is not None and choice.choices == ("A", "B", "C", "D")
    assert choice.before.startswith(parser.forced_prefix("pick"))
    for letter in choice.choices:
        parsed = parser.parse(choice.complete(letter), PICK)
        [call] = parsed.tool_calls
        assert (parsed.content, parsed.num_malformed) == ("", 0)
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "pick",
            {"letter": letter},
        )
    assert choice.complete("E") is None and choice.complete("") is None


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl", "minicpmv4_6"])
def test_the_server_writes_the_call_as_the_template_does(tiny_path, family):
    """What a model trained on the template reads back in the next turn's history. (The tiny
    Gemma 4 template writes arguments as JSON; a forced Gemma 4 call is written in Google's
    notation, as its constrained calls are: `argument_style`.)"""
    tokenizer = AutoTokenizer.from_pretrained(tiny_path(family))
    choice = choice_call(parser_of(family), "pick", LETTERS)
    for letter in choice.choices:
        assert choice.complete(letter) == rendered_call(tokenizer, family, letter)


@pytest.mark.parametrize("family", FAMILIES)
def test_values_keep_only_the_part_that_tells_them_apart(family):
    """A shared head and tail of the written values is the server's to write (for JSON, the
    quotes too); integers are written as JSON."""
    parser = parser_of(family)
    choice = choice_call(parser, "pick", one_enum(["red", "reed", "rod"]))
    assert choice.choices == ("e", "ee", "o")
    assert parser.parse(choice.complete("ee"), PICK).tool_calls[0].function.arguments == (
        '{"letter": "reed"}'
    )
    numbers = one_enum([1, 2, 3])
    numbers["properties"]["letter"]["type"] = "integer"
    assert choice_call(parser, "pick", numbers).choices == ("1", "2", "3")


@pytest.mark.parametrize(
    "schema",
    [
        {**LETTERS, "additionalProperties": True},  # the model may add arguments
        {**LETTERS, "required": []},  # the model may leave it out
        {**LETTERS, "properties": {**LETTERS["properties"], "why": {"type": "string"}}},
        one_enum(["A"]),  # nothing to choose: the model still writes the call
        {**LETTERS, "properties": {"letter": {"type": "string"}}},  # a free string
        one_enum(["A", "AB"]),  # one value is another's head: written whole
        one_enum([None, "A"]),
    ],
)
def test_a_call_with_any_other_freedom_is_not_a_choice(schema):
    assert choice_call(get_tool_parser("qwen3_xml"), "pick", schema) is None
