"""Parser behaviour without checkpoints: malformed text, content rules, streaming shape, typing."""

from __future__ import annotations

import json
import random

import pytest

from areno.errors import ConfigError
from areno.models import get_adapter, supported_model_types
from areno.protocol import ToolDefinition
from areno.tools import ContentDelta, get_tool_parser, supported_tool_formats
from tests.tools.helpers import assert_stream_matches_parse, summary

# One well-formed call to f(a=1) per format, and the same call with a broken body.
GOOD = {
    "qwen3_xml": "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
    "hermes_json": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    "gemma4": '<|tool_call>call:f{"a": 1}<tool_call|>',
}
BAD_BODY = {
    "qwen3_xml": "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",
    "hermes_json": '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',
    "gemma4": '<|tool_call>call:f{a:<|"|>unclosed}<tool_call|>',
}
FORMATS = sorted(GOOD)


def test_every_family_has_a_parser():
    for model_type in supported_model_types():
        assert get_tool_parser(get_adapter(model_type).tool_format) is not None


def test_unknown_format_names_the_supported_ones():
    with pytest.raises(ConfigError, match="'llama_json'.*gemma4, hermes_json, qwen3_xml"):
        get_tool_parser("llama_json")
    assert supported_tool_formats() == FORMATS


@pytest.mark.parametrize("fmt", FORMATS)
def test_content_whitespace_rules(fmt):
    parser, call = get_tool_parser(fmt), GOOD[fmt]
    cases = {
        f"I'll check.\n\n{call}\n{call}\n": "I'll check.",
        f"{call}\n\n{call}": "",
        f"A {call} B": "A  B",
        "\n plain text, no calls \n": "\n plain text, no calls \n",
    }
    for text, content in cases.items():
        parsed = parser.parse(text)
        assert parsed.content == content
        assert parsed.num_malformed == 0
        assert_stream_matches_parse(parser, text)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bad_body_is_content(fmt):
    parser = get_tool_parser(fmt)
    text = f"Trying.\n{BAD_BODY[fmt]}\nThen {GOOD[fmt]}"
    parsed = parser.parse(text)
    assert parsed.content == f"Trying.\n{BAD_BODY[fmt]}\nThen"
    assert summary(parsed)[1:] == ([("f", {"a": 1})], 1)
    assert_stream_matches_parse(parser, text)


@pytest.mark.parametrize("fmt", FORMATS)
def test_start_tag_in_prose_is_content_and_released_early(fmt):
    parser = get_tool_parser(fmt)
    prose = f"Wrap each call in {parser.start_tag} tags, like this:\n"
    parsed = parser.parse(prose + GOOD[fmt])
    assert parsed.content == prose.rstrip()
    assert summary(parsed)[1:] == ([("f", {"a": 1})], 1)
    # The prose does not wait for the end of the generation.
    stream = parser.stream()
    streamed = "".join(e.text for e in stream.feed(prose) if isinstance(e, ContentDelta))
    assert streamed == prose.rstrip()


@pytest.mark.parametrize("fmt", FORMATS)
def test_abandoned_call_then_restarted(fmt):
    parser, good = get_tool_parser(fmt), GOOD[fmt]
    text = good[: len(parser.start_tag) + 5] + good
    assert summary(parser.parse(text)) == (text[: -len(good)], [("f", {"a": 1})], 1)
    assert_stream_matches_parse(parser, text)


@pytest.mark.parametrize("fmt", FORMATS)
def test_unclosed_call_and_end_tag_alone(fmt):
    parser, good = get_tool_parser(fmt), GOOD[fmt]
    stray = parser.end_tag + " stray"
    assert summary(parser.parse(good + good[:-1])) == (good[:-1], [("f", {"a": 1})], 1)
    assert summary(parser.parse(stray)) == (stray, [], 0)
    for text in (good + good[:-1], stray):
        assert_stream_matches_parse(parser, text)


@pytest.mark.parametrize("fmt", FORMATS)
def test_stream_holds_back_a_possible_tag(fmt):
    parser = get_tool_parser(fmt)
    stream = parser.stream()
    tag = parser.start_tag
    assert stream.feed("Sure. " + tag[:4]) == [ContentDelta("Sure.")]
    assert stream.feed(tag[4:]) == []
    events = stream.feed(GOOD[fmt][len(tag) :] + " Done.")
    header, arguments, content = events
    assert (header.index, header.type, header.function.name) == (0, "function", "f")
    assert header.id.startswith("call_") and header.function.arguments == ""
    assert (arguments.index, arguments.id, arguments.function.name) == (0, None, None)
    assert json.loads(arguments.function.arguments) == {"a": 1}
    assert content == ContentDelta("  Done.")  # the space held before the call, then " Done."
    assert stream.finish() == []
    assert stream.feed(GOOD[fmt])[0].index == 1


def test_qwen_xml_value_types():
    parser = get_tool_parser("qwen3_xml")
    values = {"n": "42", "b": "true", "z": "null", "q": '"quoted"', "o": '{"k": [1]}', "s": "{bad"}
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    text = f"<tool_call>\n<function=f>\n{params}</function>\n</tool_call>"
    untyped = {"n": 42, "b": True, "z": None, "q": '"quoted"', "o": {"k": [1]}, "s": "{bad"}
    assert summary(parser.parse(text))[1] == [("f", untyped)]
    as_strings = {k: {"type": "string"} for k in values}
    schema = {"type": "object", "properties": as_strings}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    assert summary(parser.parse(text, tools))[1] == [("f", values)]
    validated = [ToolDefinition.model_validate(tools[0])]
    assert summary(parser.parse(text, validated))[1] == [("f", values)]


def test_qwen_xml_keeps_newlines_inside_values():
    parser = get_tool_parser("qwen3_xml")
    text = (
        "<tool_call>\n<function=f>\n<parameter=a>\n\nx\n\n</parameter>\n</function>\n</tool_call>"
    )
    assert summary(parser.parse(text))[1] == [("f", {"a": "\nx\n"})]


def test_qwen_xml_stray_text_or_repeated_key_is_malformed():
    parser = get_tool_parser("qwen3_xml")
    for inner in ("oops\n<parameter=a>\n1\n</parameter>", "<parameter=a>\n1\n</parameter>" * 2):
        text = f"<tool_call>\n<function=f>\n{inner}\n</function>\n</tool_call>"
        assert summary(parser.parse(text)) == (text, [], 1)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"name": "f", "arguments": "{\\"a\\": 1}"}', ("f", {"a": 1})),
        ('{"name": "f"}', ("f", {})),
        ('{"arguments": {}}', None),
        ('{"name": "f", "arguments": [1]}', None),
        ('{"name": "f", "arguments": {"a": NaN}}', None),
        ('{"name": "f", "arguments": {"a": 1e999}}', None),
        ('{"name": "f x", "arguments": {}}', None),
    ],
)
def test_hermes_body_shapes(body, expected):
    text = f"<tool_call>\n{body}\n</tool_call>"
    parsed = get_tool_parser("hermes_json").parse(text)
    assert summary(parsed) == (("", [expected], 0) if expected else (text, [], 1))


def test_gemma_native_argument_notation():
    q = '<|"|>'
    args = f'{{a:{q}x, "y" {q},n:3,f:-0.5,b:true,z:null,o:{{k:[1,{q}s{q}]}},w:bare word,"j":"\\""}}'
    text = f"Sure.<|tool_call>call:f{args}<tool_call|>"
    expected = {
        "a": 'x, "y" ',
        "n": 3,
        "f": -0.5,
        "b": True,
        "z": None,
        "o": {"k": [1, "s"]},
        "w": "bare word",
        "j": '"',
    }
    assert summary(get_tool_parser("gemma4").parse(text)) == ("Sure.", [("f", expected)], 0)
    assert_stream_matches_parse(get_tool_parser("gemma4"), text)


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_fragments_never_raise_and_stream_agrees(fmt):
    parser = get_tool_parser(fmt)
    fragments = [
        GOOD[fmt], BAD_BODY[fmt], parser.start_tag, parser.end_tag, parser.start_tag[:3],
        parser.end_tag[:4], "{", "}", '"', "\n", " ", "call:", "<function=f>", "</function>",
        '{"name": "g"', "<parameter=a>", "</parameter>", '<|"|>', "text", "ü东🌧",
    ]  # fmt: skip
    rng = random.Random(1)
    for seed in range(60):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 12)))
        parsed = parser.parse(text)
        assert all(json.loads(c.function.arguments) is not None for c in parsed.tool_calls)
        assert_stream_matches_parse(parser, text, seed=seed)


def test_qwen_xml_values_read_as_the_grammar_bounds_them():
    """A strict call's grammar (xgrammar's qwen_xml style, one whitespace character at most
    around a value) lets any whitespace character lay a value out, as a random model did with a
    tab: the parser reads the value without it, so the schema holds for what it returns. The
    value's own whitespace stays (one newline of layout each side, as the template writes)."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    from areno.serve.structured import _call

    parser = get_tool_parser("qwen3_xml")
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 3}},
        "required": ["city"],
    }
    spec = json.dumps({"type": "structural_tag", "format": _call(parser, "f", schema)})
    grammar = xgrammar.Grammar.from_structural_tag(spec)
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    layouts = ["\nabc\n", "abc\t", "\tabc ", " ab\n", "abc", "\nab\n\n", "\r\nab\n"]
    call = "<tool_call>\n<function=f>\n<parameter=city>{}</parameter>\n</function>\n</tool_call>"
    accepted = [v for v in layouts if _is_grammar_accept_string(grammar, call.format(v))]
    for value in accepted:
        ((_, arguments),) = summary(parser.parse(call.format(value), tools))[1]
        assert len(arguments["city"]) <= 3, (value, arguments)
    assert {"abc\t", "\tabc "} <= set(accepted)  # the layouts the old reading overran


def test_gemma_calls_refuse_the_string_bounds_their_grammar_drops():
    """xgrammar's gemma style ignores a string's minLength / maxLength (a 6-character value
    passes maxLength 3): a Gemma 4 call constrained by such a schema is refused (400 naming the
    tool and the path); the other families' grammars enforce the bounds, and keep them."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    from areno.protocol import parse_chat_request
    from areno.protocol.errors import RequestValidationError
    from areno.serve.structured import _call, structured_output

    schema = {
        "type": "object",
        "properties": {"q": {"type": "string", "maxLength": 3}},
        "required": ["q"],
    }
    gemma = get_tool_parser("gemma4")
    spec = json.dumps({"type": "structural_tag", "format": _call(gemma, "get", schema)})
    text = gemma.call_opening("get") + '{q:<|"|>abcdef<|"|>}' + gemma.call_closing
    assert _is_grammar_accept_string(xgrammar.Grammar.from_structural_tag(spec), text)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "get", "parameters": schema}}],
        "tool_choice": "required",
    }
    request = parse_chat_request(json.dumps(body).encode())
    with pytest.raises(
        RequestValidationError, match=r"'get'.*parameters\.properties\.q\.maxLength"
    ):
        structured_output(request, gemma, "", thinking=False)
    for fmt in ("qwen3_xml", "hermes_json"):
        assert structured_output(request, get_tool_parser(fmt), "", thinking=False) is not None
