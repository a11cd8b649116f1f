"""Hostile request bodies: size and structure caps, tool schemas, reserved template kwargs."""

from __future__ import annotations

import json

import pytest

from areno.protocol import errors as errors_module
from areno.protocol import parse_chat_request
from tests.protocol.test_requests import body, error_of, user


def test_oversized_and_overexpanding_bodies_are_413(monkeypatch):

    monkeypatch.setattr(errors_module, "MAX_REQUEST_BYTES", 1000)
    err = error_of(json.dumps(body(user({"type": "text", "text": "x" * 2000}))))
    assert (err.status_code, err.code) == (413, "request_too_large") and "1000" in err.message
    monkeypatch.setattr(errors_module, "MAX_REQUEST_BYTES", 1 << 20)
    monkeypatch.setattr(errors_module, "MAX_JSON_VALUES", 100)
    err = error_of(json.dumps(body(user(), metadata={"x": [[]] * 200})))
    assert err.status_code == 413 and "JSON values, over the limit of 100" in err.message
    # Marks inside strings are not values: text full of commas and brackets still parses.
    text = {"type": "text", "text": '[{"a": 1}, ' * 100 + '\\"'}
    assert parse_chat_request(json.dumps(body(user(text))).encode())


VALID_SCHEMAS = [
    {"type": "object"},
    {"type": "object", "properties": {}, "additionalProperties": False},
    {
        "type": "object",
        "properties": {
            "unit": {"type": "string", "enum": ["c", "f"], "description": "units"},
            "days": {"type": ["integer", "null"]},
            "points": {"type": "array", "items": {"type": "object", "properties": {}}},
            "pair": {"type": "array", "items": [{"type": "number"}, {"type": "number"}]},
            "any": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/box"}]},
            "free": True,
        },
        "required": ["unit"],
        "$defs": {"box": {"type": "object", "properties": {"x": {"type": "number"}}}},
    },
]
INVALID_SCHEMAS = [
    ({"type": "object", "properties": 5}, "parameters.properties must be an object"),
    ({"type": "object", "required": "x"}, "parameters.required must be a list"),
    ({"type": "object", "properties": {"x": 5}}, "parameters.properties.x must be a JSON Schema"),
    ({"type": "object", "properties": {"x": {"type": "strnig"}}}, "'strnig' is not one of"),
    ({"type": "object", "properties": {"x": {"enum": "a"}}}, "enum must be a list"),
    ({"type": "object", "anyOf": {"type": "string"}}, "anyOf must be a list of schemas"),
    ({"type": "object", "properties": {"x": {"items": "a"}}}, "items must be a JSON Schema"),
]


@pytest.mark.parametrize("schema", VALID_SCHEMAS)
def test_json_schemas_accepted(schema):
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    assert parse_chat_request(body(user(), tools=[tool])).tools[0].function.parameters == schema


@pytest.mark.parametrize(("schema", "text"), INVALID_SCHEMAS)
def test_non_json_schemas_refused(schema, text):
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    err = error_of(body(user(), tools=[tool]))
    assert err.param == "tools[0].function.parameters" and text in err.message, err.message


@pytest.mark.parametrize("key", ["tokenize", "messages", "chat_template", "add_generation_prompt"])
def test_reserved_chat_template_kwargs_refused(key):
    err = error_of(body(user(), chat_template_kwargs={key: True, "enable_thinking": False}))
    assert err.param == "chat_template_kwargs" and f"'{key}' cannot be set here" in err.message
    assert parse_chat_request(body(user(), chat_template_kwargs={"enable_thinking": False}))


# A keyword the grammar engine would drop, a schema using it, and a value the keyword forbids
# that xgrammar's grammar of the schema still accepts: why such a schema is refused.
DROPPED_KEYWORDS = [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    (
        "dependentRequired",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        '{"a": 1}',
    ),
    ("allOf (of more than one schema)", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, "2"),
    (
        "multipleOf (only positive integers, on an integer schema)",
        {"type": "number", "multipleOf": 2},
        "3",
    ),
    ("not", {"not": {"type": "string"}}, '"s"'),
]


@pytest.mark.parametrize(("keyword", "schema", "forbidden"), DROPPED_KEYWORDS)
def test_a_schema_keyword_the_grammar_would_drop_is_refused(keyword, schema, forbidden):
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, forbidden)  # what following it loosely allows
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    err = error_of(body(user(), response_format=response_format))
    assert err.param.startswith("response_format") and f"schema.{keyword}" in err.message
    parameters = {"type": "object", "properties": {"x": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters, "strict": True}}
    assert f"parameters.properties.x.{keyword}" in error_of(body(user(), tools=[tool])).message


def test_pattern_properties_are_refused_and_what_the_grammar_keeps():
    """xgrammar compiles `patternProperties` into a grammar that refuses the very objects the
    pattern allows; the keyword is refused, and the keywords it does enforce stay accepted."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "object", "patternProperties": {"^a": {"type": "integer"}}}
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert not _is_grammar_accept_string(grammar, '{"ab": 1}')
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert (
        "schema.patternProperties"
        in error_of(body(user(), response_format=response_format)).message
    )
    kept = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "multipleOf": 3, "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
            "both": {"allOf": [{"type": "string", "maxLength": 3}]},
        },
        "minProperties": 1,
    }
    response_format["json_schema"]["schema"] = kept
    assert parse_chat_request(json.dumps(body(user(), response_format=response_format)).encode())
