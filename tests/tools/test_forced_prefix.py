"""`ToolParser.forced_prefix`: the call opening the server forces for tool_choice "required" or a
named function must be what each family's template writes, survive tokenization, and parse back
in front of the model's continuation (whole and streamed)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from areno.models import get_adapter
from areno.protocol.responses import ToolCallDelta
from areno.tools import get_tool_parser
from tests.tools.helpers import assert_stream_matches_parse, summary
from tests.tools.test_round_trip import FAMILIES, TOOLS, WEATHER, render_assistant_turn

FORMATS = ("gemma4", "hermes_json", "qwen3_xml")


@pytest.fixture(scope="module")
def tokenizers(tiny_path):
    return {family: AutoTokenizer.from_pretrained(tiny_path(family)) for family in FAMILIES}


def parser_of(family: str):
    return get_tool_parser(get_adapter(family).tool_format)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", [None, "get_weather"])
def test_template_call_starts_with_the_forced_prefix(tokenizers, family, name):
    """The template's own rendering of a call begins with the prefix, so prefix + the rest of
    that rendering (what a model trained on the template writes) parses to the call."""
    text = render_assistant_turn(tokenizers[family], family, "", [WEATHER])
    parser = parser_of(family)
    prefix = parser.forced_prefix(name)
    assert text.startswith(prefix)
    assert not prefix.endswith(" ")  # the model's next token carries its own leading space

    continuation = text[len(prefix) :]
    parsed = parser.parse(prefix + continuation, TOOLS)
    assert summary(parsed) == ("", [WEATHER], 0)
    assert_stream_matches_parse(parser, prefix + continuation, TOOLS)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", [None, "get_weather"])
def test_forced_prefix_tokenizes_and_decodes_back(tokenizers, family, name):
    """The serve layer appends the prefix's token ids to the prompt: the call's start tag must
    stay one (special) token and the ids must decode to the prefix exactly."""
    tokenizer, parser = tokenizers[family], parser_of(family)
    prefix = parser.forced_prefix(name)
    ids = tokenizer.encode(prefix, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids(parser.start_tag)
    assert tokenizer.decode(ids, skip_special_tokens=False) == prefix


@pytest.mark.parametrize("fmt", FORMATS)
def test_named_prefix_writes_the_name(fmt):
    parser = get_tool_parser(fmt)
    assert "lookup.v2" in parser.forced_prefix("lookup.v2")
    assert parser.forced_prefix("lookup.v2").startswith(parser.forced_prefix(None))
    assert parser.forced_prefix(None).startswith(parser.start_tag)


@pytest.mark.parametrize("fmt", FORMATS)
def test_unfinished_forced_call_is_content_verbatim_and_malformed(fmt):
    """A model that does not complete the forced call (max_tokens, or babble) gets its text,
    prefix included, back as content, counted as malformed."""
    parser = get_tool_parser(fmt)
    text = parser.forced_prefix("get_weather") + " zq!! random words"
    parsed = parser.parse(text, TOOLS)
    assert (parsed.content, parsed.tool_calls, parsed.num_malformed) == (text, [], 1)
    closed = text + parser.end_tag
    parsed = parser.parse(closed, TOOLS)
    assert (parsed.content, parsed.tool_calls, parsed.num_malformed) == (closed, [], 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_streamed_forced_call_header_carries_the_name(fmt):
    """Fed the prefix first and the continuation in pieces, the stream's tool-call header
    delta names the forced function."""
    parser = get_tool_parser(fmt)
    continuation = {
        "gemma4": '{"city": "Paris"}<tool_call|>',
        "hermes_json": ' {"city": "Paris"}}\n</tool_call>',
        "qwen3_xml": "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    }[fmt]
    stream = parser.stream(TOOLS)
    events = stream.feed(parser.forced_prefix("get_weather"))
    for char in continuation:
        events += stream.feed(char)
    events += stream.finish()
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    assert calls[0].function.name == "get_weather" and calls[0].id
    assert calls[1].function.arguments == '{"city": "Paris"}'
    assert stream.num_calls == 1 and stream.num_malformed == 0
