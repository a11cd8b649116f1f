"""Chat-shaped JSON through everything the server runs before generating, fuzzed with hypothesis:
it either becomes a prompt or raises an `ArenoError` (a 4xx), never any other exception.

tests/protocol/test_fuzz.py holds `parse_chat_request` alone to that; here the documents go on,
as the Ingress takes them, through the sampling parameters, the tool-call prefix, media
resolution and decoding (real files under an allowed root, data URLs, refused sources) and the
checkpoint's own chat template and processor (tiny Gemma 4 and Qwen 3.5), with the fields a
template reads drawn wide: message orders, tool schemas, tool-call arguments, template kwargs.
"""

from __future__ import annotations

import base64
import functools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areno.errors import ArenoError
from areno.media import DecodeOptions, MediaDecoder, MediaPolicy, samples
from areno.processing import Processor
from areno.processing.encode import PromptLimits
from areno.protocol import parse_chat_request
from areno.protocol.chat import RESERVED_TEMPLATE_KWARGS
from areno.serve.chat import prepare, tools_in_play
from areno.serve.sampling import sampling_params
from areno.tools import get_tool_parser
from tests.protocol.test_fuzz import json_safe, json_values, mutate

FUZZ = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FAMILIES = ("gemma4", "qwen3_5")


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-media")
    samples.write_image(root / "a.png", 32, 24)
    samples.write_audio(root / "a.wav", 0.5)
    samples.write_video(root / "a.mp4", seconds=1.0, fps=2.0)
    (root / "bad.png").write_bytes(b"not an image")
    return root


@pytest.fixture(scope="module", params=FAMILIES)
def pipeline(request, tiny_path, media_root):
    """The serving steps before generation, in one process, for one family."""
    path = tiny_path(request.param)
    processor = Processor(path, limits=PromptLimits(max_prompt_tokens=900, max_context_len=2048))
    options = processor.decode_options(DecodeOptions(max_video_frames=2))
    decoder = MediaDecoder(MediaPolicy(allowed_local_media_paths=(str(media_root),)), options)
    parser = get_tool_parser(processor.adapter.tool_format)
    return functools.partial(serve_prepare, processor, decoder, parser)


def serve_prepare(processor, decoder, parser, body: Any):
    """What the Ingress does with a body up to the Generator call; None when it is refused."""
    try:
        chat = parse_chat_request(body)
        params = sampling_params(chat)
        media = decoder.decode_many(processor.media_refs(chat.messages))
        encoded = processor.encode(
            chat.messages,
            media,
            tools=chat.tools if tools_in_play(chat) else None,
            chat_template_kwargs=chat.chat_template_kwargs,
            max_new_tokens=chat.max_new_tokens,
        )
    except ArenoError as exc:
        assert 400 <= exc.status_code < 500 and exc.message, exc
        return None
    assert encoded.num_prompt_tokens > 0
    return prepare(chat, params, encoded, parser, processor.tokenizer).inputs


# --- chat-shaped documents ---------------------------------------------------------------------


def media_urls(root) -> st.SearchStrategy[str]:
    """Mostly files that decode (so the processor runs), sometimes sources that are refused."""
    png = (root / "a.png").read_bytes()
    good = st.sampled_from(
        [
            f"{root}/a.png",
            f"{root}/a.wav",
            f"{root}/a.mp4",
            f"file://{root}/a.png",
            "data:image/png;base64," + base64.b64encode(png).decode(),
        ]
    )
    bad = st.sampled_from(
        [
            f"{root}/bad.png",
            f"{root}/missing.png",
            f"{root}/../a.png",
            "data:image/png;base64,!!",
            "data:text/plain,hello",
            "http://127.0.0.1/a.png",
            "ftp://host/a.png",
        ]
    )
    return st.one_of(good, good, good, good, bad)


def content_parts(urls: st.SearchStrategy[str]) -> st.SearchStrategy[list]:
    text = st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=12))
    url_part = st.sampled_from(["image_url", "audio_url", "video_url"]).flatmap(
        lambda kind: st.builds(lambda u: {"type": kind, kind: {"url": u}}, urls)
    )
    direct = st.builds(
        lambda kind, u: {"type": kind, "url": u}, st.sampled_from(["image", "audio", "video"]), urls
    )
    return st.lists(st.one_of(text, url_part, direct), max_size=3)


schema_values = st.recursive(
    st.sampled_from(["object", "string", "array", "strnig", 5, None, True, [], {}]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["type", "properties", "required", "items", "enum", "anyOf", "x"]),
            inner,
            max_size=3,
        )
    ),
    max_leaves=8,
)
tool_schemas = st.just(
    {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
) | st.fixed_dictionaries(
    {"type": st.just("object")},
    optional={"properties": schema_values, "required": schema_values, "items": schema_values},
)
arguments = st.one_of(
    st.text(max_size=12),
    st.sampled_from(['{"x": 1}', "[1, 2]", "5", "{"]),
    st.dictionaries(st.text(max_size=4), json_safe, max_size=2),
)
tool_calls = st.lists(
    st.builds(
        lambda name, args: {
            "id": "c1",
            "type": "function",
            "function": {"name": name, "arguments": args},
        },
        st.sampled_from(["zoom", "f", ""]),
        arguments,
    ),
    max_size=2,
)
template_kwargs = st.dictionaries(
    st.sampled_from(["enable_thinking", "bos_token", "x"])
    | st.sampled_from(sorted(RESERVED_TEMPLATE_KWARGS)),
    json_safe,
    max_size=2,
)
# Sampling fields in their valid ranges: test_fuzz.py and the mutations below cover the rest.
SAMPLING = {
    "chat_template_kwargs": template_kwargs,
    "max_tokens": st.integers(1, 10**6) | st.just(10**30),
    "n": st.integers(1, 16),
    "temperature": st.floats(0, 2),
    "top_k": st.just(-1) | st.integers(1, 10**12),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "logprobs": st.booleans(),
}


@st.composite
def chat_documents(draw, root) -> dict:
    content = st.text(max_size=16) | content_parts(media_urls(root))
    text_content = st.text(max_size=16) | st.lists(
        st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=8)), max_size=2
    )
    message = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "developer"]),
                               "content": text_content}),
        st.fixed_dictionaries({"role": st.just("user"), "content": content}),
        st.fixed_dictionaries({"role": st.just("assistant")},
                              optional={"content": st.none() | text_content,
                                        "tool_calls": tool_calls,
                                        "reasoning_content": st.text(max_size=8)}),
        st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.just("c1"),
                               "content": content}),
    )  # fmt: skip
    body: dict[str, Any] = {"messages": draw(st.lists(message, min_size=1, max_size=4))}
    if draw(st.booleans()):
        names = draw(st.lists(st.sampled_from(["zoom", "pan"]), unique=True, max_size=2))
        body["tools"] = [
            {"type": "function", "function": {"name": n, "parameters": draw(tool_schemas)}}
            for n in names
        ]
        choices = ["auto", "none", "required", {"type": "function", "function": {"name": "zoom"}}]
        if draw(st.booleans()):
            body["tool_choice"] = draw(st.sampled_from(choices))
    for name, values in SAMPLING.items():
        if draw(st.integers(0, 3)) == 0:
            body[name] = draw(values)
    return body


@FUZZ
@given(data=st.data())
def test_chat_documents_become_prompts_or_4xx(pipeline, media_root, data):
    pipeline(data.draw(chat_documents(media_root)))


@FUZZ
@given(data=st.data())
def test_mutated_chat_documents_become_prompts_or_4xx(pipeline, media_root, data):
    document = data.draw(chat_documents(media_root))
    steps = data.draw(st.lists(st.integers(0, 100), min_size=1, max_size=6))
    action = data.draw(st.sampled_from(["replace", "delete", "add"]))
    pipeline(mutate(document, steps, action, data.draw(json_values)))
