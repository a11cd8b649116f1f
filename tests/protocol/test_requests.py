"""Request parsing: content parts, messages, tools, sampling fields, limits, and error paths."""

from __future__ import annotations

import json

import pytest

from areno.errors import ArenoError
from areno.protocol import (
    AssistantMessage,
    AudioPart,
    AudioURLPart,
    ChatCompletionRequest,
    ErrorResponse,
    ImagePart,
    ImageURLPart,
    InputAudioPart,
    MediaPart,
    NamedToolChoice,
    RequestValidationError,
    TextPart,
    ToolMessage,
    VideoPart,
    VideoURLPart,
    iter_media_parts,
    parse_chat_request,
)
from areno.protocol import chat as chat_module
from areno.protocol import content as content_module


def user(*parts: dict) -> dict:
    return {"role": "user", "content": list(parts)}


def body(*messages: dict, **fields) -> dict:
    return {"model": "m", "messages": list(messages), **fields}


def parse_parts(*parts: dict) -> list:
    return parse_chat_request(body(user(*parts))).messages[0].content


def error_of(data) -> RequestValidationError:
    with pytest.raises(RequestValidationError) as info:
        parse_chat_request(data)
    return info.value


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


# --- content parts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("part", "cls", "modality", "url", "options"),
    [
        (
            {"type": "image_url", "image_url": {"url": "/a.png"}},
            ImageURLPart,
            "image",
            "/a.png",
            {},
        ),
        (
            {"type": "image_url", "image_url": {"url": "http://h/a.png", "detail": "low"}},
            ImageURLPart,
            "image",
            "http://h/a.png",
            {},
        ),
        (
            {"type": "audio_url", "audio_url": {"url": "/a.wav"}},
            AudioURLPart,
            "audio",
            "/a.wav",
            {},
        ),
        (
            {"type": "video_url", "video_url": {"url": "/v.mp4"}},
            VideoURLPart,
            "video",
            "/v.mp4",
            {},
        ),
        (
            {"type": "video_url", "video_url": {"url": "/v.mp4", "fps": 2, "max_frames": 8}},
            VideoURLPart,
            "video",
            "/v.mp4",
            {"fps": 2.0, "max_frames": 8},
        ),
        ({"type": "image", "url": "/a.png"}, ImagePart, "image", "/a.png", {}),
        ({"type": "image", "path": "/a.png"}, ImagePart, "image", "/a.png", {}),
        ({"type": "image", "image": "/a.png"}, ImagePart, "image", "/a.png", {}),
        ({"type": "audio", "audio": "file:///a.wav"}, AudioPart, "audio", "file:///a.wav", {}),
        (
            {"type": "video", "video": "/v.mp4", "fps": 1.5},
            VideoPart,
            "video",
            "/v.mp4",
            {"fps": 1.5},
        ),
        (
            {"type": "video", "path": "/v.mp4", "max_frames": 4},
            VideoPart,
            "video",
            "/v.mp4",
            {"max_frames": 4},
        ),
    ],
)
def test_media_parts_parse(part, cls, modality, url, options):
    (parsed,) = parse_parts(part)
    assert isinstance(parsed, cls) and isinstance(parsed, MediaPart)
    assert (parsed.modality, parsed.media_url, parsed.media_options) == (modality, url, options)


def test_direct_forms_normalise_to_url():
    (part,) = parse_parts({"type": "image", "path": "/x.png"})
    assert part.model_dump() == {"type": "image", "url": "/x.png"}


@pytest.mark.parametrize(
    ("fmt", "mime"), [("wav", "audio/wav"), ("mp3", "audio/mpeg"), ("flac", "audio/flac")]
)
def test_input_audio_becomes_data_url(fmt, mime):
    (part,) = parse_parts(
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": fmt}}
    )
    assert isinstance(part, InputAudioPart)
    assert part.modality == "audio"
    assert part.media_url == f"data:{mime};base64,UklGRg=="


def test_string_and_list_content():
    request = parse_chat_request(
        body({"role": "user", "content": "hi"}, user({"type": "text", "text": "there"}))
    )
    assert request.messages[0].content == "hi"
    assert request.messages[1].content == [TextPart(type="text", text="there")]


def test_official_client_prompt_cache_breakpoint_is_accepted():
    part = {"type": "text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit"}}
    (parsed,) = parse_parts(part)
    assert parsed.model_dump() == {"type": "text", "text": "x"}


# --- the spec's examples ---------------------------------------------------------------------


def test_spec_audiovisual_message():
    message = {
        "role": "user",
        "content": [
            {"type": "video_url", "video_url": {"url": "/data/clip.mp4"}},
            {"type": "audio_url", "audio_url": {"url": "/data/clip.wav"}},
            {"type": "text", "text": "Describe the synchronized event."},
        ],
    }
    request = parse_chat_request(body(message))
    media = [(i, p.modality, p.media_url) for i, p in request.media_parts()]
    assert media == [(0, "video", "/data/clip.mp4"), (0, "audio", "/data/clip.wav")]


def test_spec_input_audio_and_client_example():
    audio = {"type": "input_audio", "input_audio": {"data": "<base64-data>", "format": "wav"}}
    image = {"type": "image_url", "image_url": {"url": "/data/example.png"}}
    text = {"type": "text", "text": "Describe this image."}
    request = parse_chat_request(
        {
            "model": "multimodal-model",
            "messages": [user(audio), user(image, text)],
            "max_tokens": 128,
        }
    )
    assert request.max_new_tokens == 128
    assert [p.media_url for _, p in request.media_parts()] == [
        "data:audio/wav;base64,<base64-data>",
        "/data/example.png",
    ]


# --- messages ----------------------------------------------------------------------------------


def test_all_roles_and_typed_tool_message():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": [{"type": "text", "text": "use tools"}]},
        user({"type": "text", "text": "look"}, {"type": "image", "image": "/a.png"}),
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "need a screenshot",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "shot", "arguments": "{}"},
                }
            ],
            "refusal": None,  # echoed back by clients; ignored
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [
                {"type": "text", "text": "here"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
            ],
        },
    ]
    request = parse_chat_request(body(*messages))
    assistant, tool = request.messages[3], request.messages[4]
    assert (
        isinstance(assistant, AssistantMessage) and assistant.tool_calls[0].function.name == "shot"
    )
    assert isinstance(tool, ToolMessage) and tool.tool_call_id == "call_1"
    assert [(i, p.modality) for i, p in iter_media_parts(request.messages)] == [
        (2, "image"),
        (4, "image"),
    ]


def test_assistant_arguments_object_and_null_tool_calls():
    call = {"function": {"name": "f", "arguments": {"x": 1}}}
    request = parse_chat_request(
        body(
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "assistant", "content": "ok", "tool_calls": None},
        )
    )
    assert request.messages[1].tool_calls[0].function.arguments == {"x": 1}
    assert request.messages[2].tool_calls == []


# --- tools ------------------------------------------------------------------------------------


def test_tools_and_named_choice():
    request = parse_chat_request(
        body(
            {"role": "user", "content": "x"},
            tools=[TOOL],
            tool_choice={"type": "function", "function": {"name": "lookup"}},
            parallel_tool_calls=False,
        )
    )
    assert isinstance(request.tool_choice, NamedToolChoice)
    assert request.tools[0].function.parameters == {"type": "object"}


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_none_and_auto_need_no_tools(choice):
    assert parse_chat_request(body(user(), tool_choice=choice)).tool_choice == choice


def test_required_needs_tools():
    assert "non-empty 'tools'" in error_of(body(user(), tool_choice="required")).message
    assert parse_chat_request(body(user(), tools=[TOOL], tool_choice="required"))


def test_duplicate_tool_names():
    err = error_of(body(user(), tools=[TOOL, TOOL]))
    assert err.param == "tools" and "repeated: lookup" in err.message


# --- sampling fields ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 0),
        ("temperature", 2),
        ("top_p", 1),
        ("top_p", 0.01),
        ("top_k", -1),
        ("top_k", 1),
        ("top_k", 50),
        ("min_p", 0),
        ("min_p", 1),
        ("presence_penalty", -2),
        ("frequency_penalty", 2),
        ("repetition_penalty", 1.1),
        ("n", 16),
        ("seed", 2**63),
        ("stop", "###"),
        ("stop", ["a"] * 16),
        ("stop_token_ids", [0, 151645]),
        ("chat_template_kwargs", {"enable_thinking": False}),
        ("metadata", {"run": "1"}),
        ("user", "u1"),
    ],
)
def test_sampling_bounds_accept(field, value):
    assert getattr(parse_chat_request(body(user(), **{field: value})), field) == value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.01),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("repetition_penalty", 0),
        ("n", 0),
        ("n", 17),
        ("max_tokens", 0),
        ("max_completion_tokens", -5),
        ("top_logprobs", 21),
        ("stop", ["a"] * 17),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("seed", 2**64),
    ],
)
def test_sampling_bounds_reject(field, value):
    err = error_of(body(user(), logprobs=True, **{field: value}))
    assert err.param is not None and err.param.split("[")[0] == field


def test_max_new_tokens_precedence():
    def max_new(**fields):
        return parse_chat_request(body(user(), **fields)).max_new_tokens

    assert max_new() is None
    assert max_new(max_tokens=10) == 10
    assert max_new(max_completion_tokens=20) == 20
    assert max_new(max_tokens=10, max_completion_tokens=20) == 20


def test_stream_options_need_stream():
    assert error_of(body(user(), stream_options={"include_usage": True})).param == "stream_options"
    request = parse_chat_request(body(user(), stream=True, stream_options={"include_usage": True}))
    assert request.include_usage
    assert not parse_chat_request(body(user(), stream=True)).include_usage


def test_logprobs_and_nulls():
    request = parse_chat_request(body(user(), logprobs=True, top_logprobs=5))
    assert (request.logprobs, request.top_logprobs) == (True, 5)
    request = parse_chat_request(body(user(), logprobs=None, n=None, stream=None, top_logprobs=0))
    assert (request.logprobs, request.n, request.stream) == (False, 1, False)


def test_neutral_values_of_unimplemented_fields_pass_and_unknown_fields_are_refused():
    request = parse_chat_request(
        body(user(), store=False, response_format={"type": "text"}, service_tier="auto")
    )
    assert request.store is None and request.stop_sequences == []
    with pytest.raises(RequestValidationError) as caught:
        parse_chat_request(body(user(), frobnicate=1))
    assert caught.value.param == "frobnicate"


# --- errors name the user's JSON path ---------------------------------------------------------

IMAGE = {"type": "image_url", "image_url": {"url": "/a.png"}}


@pytest.mark.parametrize(
    ("data", "path", "text"),
    [
        (
            body(user(IMAGE, {"type": "image_url", "image_url": {}})),
            "messages[0].content[1].image_url.url",
            "Field required",
        ),
        (
            body(user({"type": "picture", "url": "x"})),
            "messages[0].content[0].type",
            "unknown type 'picture'; expected one of: 'text', 'image_url'",
        ),
        (body(user({"url": "x"})), "messages[0].content[0].type", "Field required"),
        (
            body(user({"type": "image_url", "image_url": {"url": "x", "detail": "max"}})),
            "messages[0].content[0].image_url.detail",
            "'auto', 'low', 'high'",
        ),
        (
            body({"role": "user", "content": 7}),
            "messages[0].content",
            "a string or an array of content parts",
        ),
        (
            body(user({"type": "text", "text": "x", "txt": "y"})),
            "messages[0].content[0].txt",
            "Unknown field",
        ),
        (
            body(user({"type": "image", "url": "a", "path": "b"})),
            "messages[0].content[0]",
            "exactly one of 'url', 'path' or 'image'",
        ),
        (
            body(user({"type": "video"})),
            "messages[0].content[0]",
            "exactly one of 'url', 'path' or 'video'",
        ),
        (
            body(user({"type": "video_url", "video_url": {"url": "x", "fps": 0}})),
            "messages[0].content[0].video_url.fps",
            "greater than 0",
        ),
        (
            body(user({"type": "input_audio", "input_audio": {"data": "AA", "format": "midi"}})),
            "messages[0].content[0].input_audio.format",
            "'wav'",
        ),
        (body({"role": "system", "content": [IMAGE]}), "messages[0].content[0]", "only text parts"),
        (body({"role": "robot", "content": "x"}), "messages[0].role", "unknown role 'robot'"),
        (body({"role": "tool", "content": "x"}), "messages[0].tool_call_id", "Field required"),
        (
            body(
                user(), tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]
            ),
            "tools[0].function.parameters",
            "JSON object",
        ),
        (
            body(
                user(),
                tools=[
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ],
            ),
            "tools[0].function.parameters",
            '"type": "object"',
        ),
        (
            body(
                user(), tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}
            ),
            "tool_choice",
            "'nope', which is not in 'tools' (lookup)",
        ),
        (
            body(user(), tool_choice={"type": "function", "function": {"name": "f"}}),
            "tool_choice",
            "the request has no tools",
        ),
        (body(user(), top_logprobs=3), "top_logprobs", "requires 'logprobs': true"),
        (body(user(), n=0), "n", "greater than or equal to 1"),
        ({"messages": []}, "messages", "at least 1 item"),
        ({"model": "m"}, "messages", "Field required"),
        (body(user(), temperature="hot"), "temperature", "valid number"),
    ],
)
def test_error_names_json_path(data, path, text):
    err = error_of(data)
    assert err.param == path
    assert f"{path}: " in err.message and text in err.message
    assert err.status_code == 400 and err.code == "invalid_request"


def test_every_error_is_listed():
    err = error_of(body(user({"type": "image_url", "image_url": {}}), {"role": "x"}, n=0))
    assert [e.path for e in err.errors] == [
        "messages[0].content[0].image_url.url",
        "messages[1].role",
        "n",
    ]
    assert err.message.startswith("Invalid request (3 errors): ")


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (b'{"messages": [', "not valid JSON"),
        ('{"temperature": NaN}', "NaN is not a JSON number"),
        (b'{"model": "\xff"}', "not valid UTF-8 (byte 11)"),
        (b"[1, 2]", "must be a JSON object, got an array"),
        ("null", "must be a JSON object, got null"),
        ("[" * 100_000 + "]" * 100_000, "nests deeper than the limit"),
        (json.dumps(body(user({"type": "text", "text": "\ud800"}))), "lone UTF-16 surrogate"),
    ],
)
def test_bad_bodies(data, text):
    err = error_of(data)
    assert text in err.message and isinstance(err, ArenoError)


def test_bom_and_bytes_accepted():
    raw = json.dumps(body(user(IMAGE))).encode()
    assert parse_chat_request(b"\xef\xbb\xbf" + raw).messages[0].content[0].media_url == "/a.png"
    assert parse_chat_request(bytearray(raw)).model == "m"


def test_part_limits(monkeypatch):
    text = {"type": "text", "text": "x"}
    err = error_of(body(user(*[text] * 513)))
    assert err.param == "messages[0].content"
    assert "513 content parts exceed the limit of 512 per message" in err.message
    monkeypatch.setattr(content_module, "MAX_PARTS_PER_MESSAGE", 2)
    monkeypatch.setattr(chat_module, "MAX_PARTS_PER_REQUEST", 4)
    assert error_of(body(user(text, text, text))).param == "messages[0].content"
    err = error_of(body(user(text, text), user(text, text), user(text)))
    assert err.param == "messages" and "5 content parts exceed the limit of 4" in err.message
    assert parse_chat_request(body(user(text, text), user(text, text)))


def test_error_body_shape():
    err = error_of(body(user(), n=0))
    assert ErrorResponse.from_error(err).model_dump() == {
        "error": {
            "message": err.message,
            "type": "invalid_request_error",
            "param": "n",
            "code": "invalid_request",
        }
    }


def test_model_validate_directly():
    request = ChatCompletionRequest.model_validate(body(user(IMAGE)))
    assert isinstance(request.messages[0].content[0], ImageURLPart)


def test_error_pickles_and_builds_like_any_areno_error():
    import pickle

    err = error_of(body(user({"type": "image_url", "image_url": {}}), n=0))
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.message, copy.param, copy.errors) == (err.message, err.param, err.errors)
    plain = RequestValidationError("too big", param="messages")
    assert plain.to_dict()["param"] == "messages" and "messages: too big" in plain.message
