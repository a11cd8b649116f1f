"""Untrusted bodies either parse or raise RequestValidationError, never anything else.

Three sources of bodies: valid requests built from the wire format (which must parse), the same
requests with one node replaced, deleted or added (which may go either way), and arbitrary JSON
values, text and bytes.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areno.protocol import (
    CONTENT_PART_TYPES,
    ChatCompletionRequest,
    RequestValidationError,
    parse_chat_request,
)

FUZZ = settings(
    derandomize=True,
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def json_like(floats: st.SearchStrategy[float]) -> st.SearchStrategy[Any]:
    leaves = st.none() | st.booleans() | st.integers() | floats | st.text(max_size=8)
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
        ),
        max_leaves=20,
    )


json_values = json_like(st.floats())  # NaN and Infinity included: the parser must refuse them
json_safe = json_like(st.floats(allow_nan=False, allow_infinity=False))
scalars = st.none() | st.booleans() | st.integers() | st.floats(-1e6, 1e6) | st.text(max_size=8)

# --- valid requests ----------------------------------------------------------------------------

urls = st.sampled_from(["/data/a.png", "data:image/png;base64,AA==", "http://h/v.mp4", "clip.wav"])
video_options = {"fps": st.floats(0.1, 30), "max_frames": st.integers(1, 64)}
MEDIA_OBJECTS = {
    "image_url": st.fixed_dictionaries(
        {"url": urls}, optional={"detail": st.sampled_from(["auto", "low", "high"])}
    ),
    "audio_url": st.fixed_dictionaries({"url": urls}),
    "video_url": st.fixed_dictionaries({"url": urls}, optional=video_options),
    "input_audio": st.fixed_dictionaries(
        {"data": st.just("UklGRg=="), "format": st.sampled_from(["wav", "mp3", "ogg"])}
    ),
}


def part_of(kind: str) -> st.SearchStrategy[dict]:
    if kind == "text":
        return st.fixed_dictionaries({"type": st.just(kind), "text": st.text(max_size=8)})
    if kind in MEDIA_OBJECTS:
        return st.fixed_dictionaries({"type": st.just(kind), kind: MEDIA_OBJECTS[kind]})
    options = video_options if kind == "video" else {}
    key = st.sampled_from(["url", "path", kind])
    return st.tuples(key, urls, st.fixed_dictionaries({}, optional=options)).map(
        lambda t: {"type": kind, t[0]: t[1], **t[2]}
    )


text_parts = st.lists(part_of("text"), max_size=3)
any_parts = st.lists(st.sampled_from(CONTENT_PART_TYPES).flatmap(part_of), max_size=4)
text_content = st.text(max_size=8) | text_parts
media_content = st.text(max_size=8) | any_parts
arguments = st.just("{}") | st.dictionaries(st.text(max_size=3), scalars, max_size=2)
tool_call = st.fixed_dictionaries(
    {"id": st.just("call_1"), "type": st.just("function")},
).map(lambda d: d | {"function": {"name": "f", "arguments": "{}"}})
messages = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer"]), "content": text_content}
    ),
    st.fixed_dictionaries(
        {"role": st.just("user"), "content": media_content}, optional={"name": st.text(max_size=3)}
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant")},
        optional={
            "content": st.none() | text_content,
            "tool_calls": st.lists(tool_call, max_size=2),
            "reasoning_content": st.text(max_size=4),
        },
    ),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "tool_call_id": st.just("call_1"), "content": media_content}
    ),
)
tool_names = st.lists(st.sampled_from(["f", "get.weather", "a-b_c"]), unique=True, max_size=3)


@st.composite
def tools_and_choice(draw) -> dict[str, Any]:
    names = draw(tool_names)
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in names
    ]
    modes = ["none", "auto"] + (["required"] if names else [])
    named = [{"type": "function", "function": {"name": n}} for n in names]
    out: dict[str, Any] = {"tools": tools} if names or draw(st.booleans()) else {}
    if draw(st.booleans()):
        out["tool_choice"] = draw(st.sampled_from(modes + named))
    return out


sampling = st.fixed_dictionaries(
    {},
    optional={
        "model": st.text(max_size=4),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.sampled_from([-1, 1, 40]),
        "min_p": st.floats(0, 1),
        "max_tokens": st.integers(1, 4096),
        "max_completion_tokens": st.integers(1, 4096),
        "n": st.integers(1, 16),
        "seed": st.integers(-(2**63), 2**64 - 1),
        "stop": st.text(min_size=1, max_size=3)
        | st.lists(st.text(min_size=1, max_size=3), max_size=4),
        "stop_token_ids": st.lists(st.integers(0, 10**6), max_size=3),
        "chat_template_kwargs": st.dictionaries(st.text(max_size=4), scalars, max_size=2),
        "presence_penalty": st.floats(-2, 2),
        "logit_bias": st.dictionaries(
            st.integers(0, 10**5).map(str), st.floats(-100, 100), max_size=3
        ),
        "store": st.just(False),
    },
)
valid_requests = st.builds(
    lambda msgs, tools, fields, stream, logprobs: (
        {"messages": msgs} | tools | fields | stream | logprobs
    ),
    st.lists(messages, min_size=1, max_size=4),
    tools_and_choice(),
    sampling,
    st.sampled_from(
        [{}, {"stream": True}, {"stream": True, "stream_options": {"include_usage": True}}]
    ),
    st.sampled_from(
        [{}, {"logprobs": True}, {"logprobs": True, "top_logprobs": 5}, {"logprobs": False}]
    ),
)

# --- mutations -----------------------------------------------------------------------------------


def mutate(data: dict, steps: list[int], action: str, value: Any) -> dict:
    """Follow `steps` (each taken modulo the number of children) and change the node found."""
    data = copy.deepcopy(data)
    parent: Any = data
    for i, step in enumerate(steps):
        keys = list(parent) if isinstance(parent, dict) else list(range(len(parent)))
        if not keys:
            break
        key = keys[step % len(keys)]
        child = parent[key]
        if i == len(steps) - 1 or not isinstance(child, (dict, list)) or not child:
            if action == "delete":
                del parent[key]
            elif action == "add" and isinstance(parent, dict):
                parent[f"x{step}"] = value
            else:
                parent[key] = value
            break
        parent = child
    return data


mutated_requests = st.builds(
    mutate,
    valid_requests,
    st.lists(st.integers(0, 100), min_size=1, max_size=6),
    st.sampled_from(["replace", "delete", "add"]),
    json_values,
)

# --- the property --------------------------------------------------------------------------------


def check(data: Any) -> ChatCompletionRequest | None:
    """Parse `data`; any outcome but a request or a RequestValidationError fails the test."""
    try:
        request = parse_chat_request(data)
    except RequestValidationError as exc:
        assert exc.message.startswith("Invalid request (") and exc.errors
        assert exc.param is None or isinstance(exc.param, str)
        return None
    assert isinstance(request, ChatCompletionRequest)
    for _, part in request.media_parts():
        assert isinstance(part.media_url, str) and isinstance(part.media_options, dict)
    # What parsed once parses again, unchanged, from its own JSON.
    again = parse_chat_request(request.model_dump_json(exclude_none=True))
    assert again.model_dump() == request.model_dump()
    return request


@FUZZ
@given(valid_requests)
def test_valid_requests_parse(data):
    assert check(data) is not None
    assert check(json.dumps(data).encode()) is not None


@FUZZ
@given(mutated_requests)
def test_mutated_requests(data):
    check(data)


@FUZZ
@given(json_values)
def test_any_json_value(data):
    check(data)
    check(json.dumps(data))


@FUZZ
@given(st.binary(max_size=64) | st.text(max_size=64))
def test_any_bytes_or_text(data):
    check(data)
