"""Tools on the open Gemma 4 app: they reach the chat template unless tool_choice is "none", a
required or named choice forces the call's opening (streamed as the whole reply holds it), a strict
tool's arguments follow its schema; and each completion's ARENO_LOG_COMPLETIONS record, with
digests of the caller's `user` and `metadata`, never their values."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serve.live.openai_server.client import ask, completion_log


def test_tools_reach_the_template_unless_tool_choice_is_none(server, media):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "zoom",
                "description": "Crop and zoom into the image.",
                "parameters": {"type": "object", "properties": {"x": {"type": "number"}}},
            },
        }
    ]
    history = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": media["image"]}},
                {"type": "text", "text": "Zoom in."},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "zoom", "arguments": '{"x": 0.5}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "zoomed"},
    ]

    def prompt_tokens(**kwargs) -> int:
        response = server.chat.completions.create(
            model="tiny-gemma4", messages=history, max_tokens=4, temperature=0, **kwargs
        )
        assert response.choices[0].finish_reason in {"stop", "length", "tool_calls"}
        return response.usage.prompt_tokens

    without = prompt_tokens()
    assert prompt_tokens(tools=tools, tool_choice="auto") > without
    assert prompt_tokens(tools=tools, tool_choice="none") == without


def test_completions_are_logged_with_areno_log_completions(server):
    """The record carries digests of the caller's `user` and `metadata` (their only effect:
    AReno stores no completions), so a client can find its completions; never the values."""
    from areno.serve.metrics import caller_digests

    response = ask(server, "Log me.", user="alice", metadata={"run": "r1"})
    record = completion_log(response.id)
    assert record["prompt_tokens"] == response.usage.prompt_tokens
    assert {"finish_reason", "tool_calls"} <= set(record["choices"][0])
    digests = caller_digests("alice", {"run": "r1"})
    assert record["user_digest"] == digests["user_digest"]
    assert record["metadata_digest"] == digests["metadata_digest"]
    assert "alice" not in json.dumps(record) and "r1" not in json.dumps(record)
    assert "user_digest" not in completion_log(ask(server, "Log me too.").id)


ZOOM = {
    "type": "function",
    "function": {
        "name": "zoom",
        "description": "Crop and zoom into the image.",
        "parameters": {"type": "object", "properties": {"x": {"type": "number"}}},
    },
}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}


def _tool_ask(client, tool_choice, **kwargs):
    return ask(client, "Zoom in.", tools=[NOTE, ZOOM], tool_choice=tool_choice, **kwargs)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_choice_forces_the_call_opening(server, tokenizer, choice):
    """The forced opening: the prompt carries it (prompt_tokens grow by its tokens) and the reply
    is parsed after it; cut at 4 tokens, before the grammar lets the call end, the unfinished
    call comes back as content that starts with it (naming the function for a named choice),
    counted as malformed. (Whole calls: test_a_strict_tool_call_validates_against_its_schema.)"""
    from areno.tools import get_tool_parser

    named = {"type": "function", "function": {"name": "zoom"}}
    prefix = get_tool_parser("gemma4").forced_prefix("zoom" if choice == "named" else None)
    auto = _tool_ask(server, "auto", max_tokens=4)
    forced = _tool_ask(server, named if choice == "named" else "required", max_tokens=4)
    num_prefix_tokens = len(tokenizer.encode(prefix, add_special_tokens=False))
    assert forced.usage.prompt_tokens == auto.usage.prompt_tokens + num_prefix_tokens

    [answer] = forced.choices
    assert answer.message.content.startswith(prefix)
    assert not answer.message.tool_calls
    assert answer.finish_reason in {"stop", "length"}  # never "tool_calls" without a call
    assert completion_log(forced.id)["malformed_tool_calls"] == 1


def test_named_tool_choice_streams_what_the_unary_reply_holds(server):
    named = {"type": "function", "function": {"name": "zoom"}}
    full = _tool_ask(server, named, max_tokens=6)
    stream = _tool_ask(server, named, max_tokens=6, stream=True)
    content, calls, finish = "", [], None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert content == full.choices[0].message.content
    assert content.startswith("<|tool_call>call:zoom")
    assert calls == [] and finish == full.choices[0].finish_reason


def test_named_tool_choice_outside_tools_is_400(server):
    with pytest.raises(openai.BadRequestError) as caught:
        _tool_ask(server, {"type": "function", "function": {"name": "pan"}})
    assert "'pan'" in caught.value.message and "zoom" in caught.value.message


STRICT_PAN = {
    "type": "function",
    "function": {
        "name": "pan",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "direction": {"enum": ["left", "right"]},
                "steps": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["direction", "steps"],
            "additionalProperties": False,
        },
    },
}


def test_a_strict_tool_call_validates_against_its_schema(server):

    response = ask(server, "Pan.", tools=[STRICT_PAN], tool_choice="required", max_tokens=64)
    [choice] = response.choices
    [call] = choice.message.tool_calls
    assert call.function.name == "pan" and choice.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), STRICT_PAN["function"]["parameters"])
