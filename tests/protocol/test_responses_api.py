"""The Responses API request: what it translates into on the chat path (messages, tools, tool
choice, text format, limits, sampling fields), and what it refuses, each problem named at the
Responses request's own path. Every request field is listed in one table below, so a field
added without a translation or a refusal fails here."""

from __future__ import annotations

import pytest
from openai.types.responses import response_create_params

from areno.protocol import RequestValidationError
from areno.protocol.responses_api import (
    CHAT_EXTENSIONS,
    UNSUPPORTED_FIELDS,
    ResponsesRequest,
    parse_responses_request,
    to_chat_request,
)

ZOOM = {"type": "function", "name": "zoom", "parameters": {"type": "object"}}


def chat(body: dict):
    return to_chat_request(parse_responses_request(body))


def refusal(body: dict) -> RequestValidationError:
    with pytest.raises(RequestValidationError) as caught:
        chat(body)
    return caught.value


def dumped(body: dict) -> list[dict]:
    return [m.model_dump(exclude_none=True) for m in chat(body).messages]


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    assert dumped({"input": "Hi.", "instructions": "Be brief."}) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi."},
    ]


def test_input_parts_become_the_chat_paths_parts():
    parts = [
        {"type": "input_text", "text": "Look and listen."},
        {"type": "input_image", "image_url": "/data/a.png", "detail": "auto"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "/data/v.mp4", "fps": 2}},
    ]
    [message] = dumped({"input": [{"role": "user", "content": parts}]})
    assert message["content"] == [
        {"type": "text", "text": "Look and listen."},
        {"type": "image_url", "image_url": {"url": "/data/a.png", "detail": "auto"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "/data/v.mp4", "fps": 2.0}},
    ]
    request = chat({"input": [{"role": "user", "content": parts}]})
    assert [part.modality for _, part in request.media_parts()] == ["image", "audio", "video"]


def test_a_tool_loop_becomes_assistant_tool_calls_and_a_tool_message():
    """An earlier reply sent back whole (reasoning, text, calls with their ids and status) is
    one assistant turn; each output is a tool message answering its call."""
    items = [
        {"role": "user", "content": "Zoom twice."},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [
            {"type": "reasoning_text", "text": "Two calls."}
        ]},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Zooming.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "zoom",
         "arguments": '{"x": 1}', "status": "completed"},
        {"type": "function_call", "call_id": "call_b", "name": "zoom", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "zoomed once"},
        {"type": "function_call_output", "call_id": "call_b", "output": [
            {"type": "input_text", "text": "zoomed"},
            {"type": "input_image", "image_url": "/data/crop.png"},
        ]},
    ]  # fmt: skip
    messages = dumped({"input": items, "tools": [ZOOM]})
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    turn = messages[1]
    assert turn["reasoning_content"] == "Two calls." and turn["content"] == "Zooming."
    assert [(c["id"], c["function"]["arguments"]) for c in turn["tool_calls"]] == [
        ("call_a", '{"x": 1}'),
        ("call_b", "{}"),
    ]
    assert messages[2] == {"role": "tool", "tool_call_id": "call_a", "content": "zoomed once"}
    assert messages[3]["content"][1]["image_url"]["url"] == "/data/crop.png"


def test_assistant_turns_split_where_a_new_one_begins():
    items = [
        {"type": "function_call", "call_id": "a", "name": "zoom", "arguments": "{}"},
        {"role": "assistant", "content": "Done."},
        {"role": "assistant", "content": "Anything else?"},
    ]
    messages = dumped({"input": items})
    assert [(m["role"], m.get("content"), len(m["tool_calls"])) for m in messages] == [
        ("assistant", None, 1),
        ("assistant", "Done.", 0),
        ("assistant", "Anything else?", 0),
    ]


def test_tools_choice_format_and_limits_map_to_chat_fields():
    strict = ZOOM | {"strict": True, "description": "Zoom in."}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = chat(
        {
            "input": "Hi.",
            "tools": [strict],
            "tool_choice": {"type": "function", "name": "zoom"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_schema", "name": "out", "schema": schema}},
            "max_output_tokens": 12,
            "temperature": 0.5,
            "top_p": 0.9,
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 3,
            "stream": True,
            "user": "u",
            "metadata": {"k": "v"},
            "top_k": 4,
            "seed": 1,
        }
    )
    function = request.tools[0].function
    assert (function.name, function.strict, function.description) == ("zoom", True, "Zoom in.")
    assert request.tool_choice.function.name == "zoom"
    assert request.parallel_tool_calls is False
    assert request.response_format.json_schema.schema_ == schema
    assert request.max_new_tokens == 12 and request.n == 1
    assert (request.temperature, request.top_p, request.top_k, request.seed) == (0.5, 0.9, 4, 1)
    assert request.logprobs and request.top_logprobs == 3 and request.stream
    assert (request.user, request.metadata) == ("u", {"k": "v"})
    assert chat(
        {"input": "x", "text": {"format": {"type": "json_object"}}}
    ).response_format.type == ("json_object")
    assert not chat({"input": "x"}).logprobs


@pytest.mark.parametrize(
    ("body", "path", "words"),
    [
        ({"store": True}, "store", "stateless"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
        ({"conversation": "conv_1"}, "conversation", "stateless"),
        ({"background": True}, "background", "foreground"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "chat_template_kwargs"),
        ({"truncation": "auto"}, "truncation", "refuses"),
        ({"n": 2}, "n", "Unknown field"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "logprobs"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "hosted"),
        ({"tools": [ZOOM | {"parameters": {"type": "array"}}]}, "tools[0].parameters", "object"),
        ({"tools": [ZOOM, ZOOM]}, "tools", "unique"),
        (
            {"tools": [ZOOM], "tool_choice": {"type": "function", "name": "pan"}},
            "tool_choice",
            "pan",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice.type", "function"),
        (
            {"text": {"format": {"type": "json_schema", "name": "s", "schema": {"not": {}}}}},
            "text.format.schema",
            "cannot enforce",
        ),
        ({"text": {"verbosity": "high"}}, "text.verbosity", "medium"),
        ({"max_output_tokens": 4, "min_tokens": 8}, "min_tokens", "4"),
        ({"top_k": 0}, "top_k", "-1"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options", "stream"),
        ({"input": []}, "input", "at least one"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "stateless"),
        ({"input": [{"type": "mcp_call"}]}, "input[0]", "'function_call_output'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
            "input_file",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0].file_id",
            "Files API",
        ),
        (
            {"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
            "only text",
        ),
        (
            {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]},
            "input[0].encrypted_content",
            "encrypt",
        ),
    ],
)
def test_refusals_name_the_field(body, path, words):
    error = refusal({"input": "Hi."} | body)
    assert error.status_code == 400
    assert error.param == path, error.message
    assert words in error.message


def test_a_chat_rule_broken_deep_in_the_input_is_named_at_the_input_item(monkeypatch):
    from areno.protocol import content

    monkeypatch.setattr(content, "MAX_PARTS_PER_MESSAGE", 1)
    parts = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    items = [{"role": "user", "content": "x"}, {"role": "user", "content": parts}]
    error = refusal({"input": items, "instructions": "Be brief."})
    assert error.param == "input[1].content" and "limit of 1" in error.message


def test_every_request_field_is_translated_or_refused():
    """OpenAI's create parameters, and each field of the request, land in one of: translated
    (above), a chat extension, or refused unless neutral."""
    translated = {
        "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
        "max_output_tokens", "temperature", "top_p", "top_logprobs", "include", "stream",
        "stream_options", "user", "metadata",
    }  # fmt: skip
    fields = set(ResponsesRequest.model_fields)
    assert fields == translated | set(CHAT_EXTENSIONS) | set(UNSUPPORTED_FIELDS)
    openai_fields = set(response_create_params.ResponseCreateParamsBase.__annotations__)
    assert openai_fields - {"stream"} <= translated | set(UNSUPPORTED_FIELDS)
    for name, (neutral, _) in UNSUPPORTED_FIELDS.items():
        chat({"input": "x", name: neutral})  # the neutral value asks for nothing
        assert refusal({"input": "x", name: "something"}).param == name
