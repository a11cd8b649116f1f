"""Sample: validation through the serving validator, redaction of private data, JSON round trip."""

from __future__ import annotations

import json

import pytest

from areno.data import REDACTED, PublicSample, Sample, SampleError

CANARY = "CANARY-7f3a"
MESSAGES = [
    {"role": "system", "content": "Answer in <answer></answer> tags."},
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": "file:///data/dog.png"}},
            {"type": "text", "text": "What is the animal doing?"},
        ],
    },
]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "zoom", "parameters": {"type": "object", "properties": {}}},
    }
]


def make(**kwargs) -> Sample:
    fields = {"messages": MESSAGES, "tools": TOOLS, "private": {"answer": CANARY}, "id": "s1"}
    return Sample(**{**fields, **kwargs})


def test_valid_sample_keeps_messages_as_given():
    sample = make()
    assert sample.messages is MESSAGES
    assert sample.private == {"answer": CANARY}


def test_private_values_never_reach_repr_str_or_public():
    sample = make(private={"answer": CANARY, "aliases": [CANARY, "x"], "meta": {"k": CANARY}})
    for text in (repr(sample), str(sample), f"{sample}", json.dumps(sample.public().to_dict())):
        assert CANARY not in text
    assert CANARY not in json.dumps(sample.public().messages)
    assert CANARY not in repr(sample.public())
    assert "'answer': '<redacted>'" in repr(sample)
    assert f"'aliases': '{REDACTED}'" in str(sample)


def test_public_is_a_deep_copy():
    sample = make()
    public = sample.public()
    assert isinstance(public, PublicSample)
    assert (public.id, public.messages, public.tools) == ("s1", MESSAGES, TOOLS)
    public.messages[1]["content"][1]["text"] = "changed"
    public.tools[0]["function"]["name"] = "changed"
    assert sample.messages[1]["content"][1]["text"] == "What is the animal doing?"
    assert sample.tools[0]["function"]["name"] == "zoom"
    assert not hasattr(public, "private")


def test_malformed_message_names_sample_and_path():
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    with pytest.raises(SampleError, match=r"sample 'q-17': messages\[0\]\.content\[0\]") as info:
        Sample(messages=bad, id="q-17")
    assert "image_url.url: Field required" in info.value.message
    assert info.value.param == "messages[0].content[0].image_url.url"


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list of message dicts, got str"),
        ([{"role": "user", "content": "hi"}, "oops"], r"messages\[1\] must be a dict"),
        ([{"role": "robot", "content": "hi"}], "unknown role 'robot'"),
        ([{"role": "user", "content": [{"type": "txt", "text": "x"}]}], "unknown type 'txt'"),
    ],
)
def test_bad_messages(messages, expected):
    with pytest.raises(SampleError, match=expected):
        Sample(messages=messages, id="s")


def test_error_without_id_says_so():
    with pytest.raises(SampleError, match=r"^sample \(no id\): "):
        Sample(messages=[])


def test_bad_tools_and_fields():
    bad_tool = [{"type": "function", "function": {"name": "has space"}}]
    with pytest.raises(SampleError, match=r"sample 's1': tools\[0\]\.function\.name"):
        make(tools=bad_tool)
    with pytest.raises(SampleError, match="tools must be a list"):
        make(tools={"type": "function"})
    with pytest.raises(SampleError, match="private must be a dict"):
        make(private=["answer"])
    with pytest.raises(SampleError, match="id must be a string"):
        make(id=7)


def test_json_round_trip_keeps_unicode_and_private():
    sample = make(private={"answer": "café ☕", "segments": [[1.5, 2.0]]})
    line = sample.to_json()
    assert "\n" not in line
    assert json.loads(line) == {
        "id": "s1",
        "messages": MESSAGES,
        "tools": TOOLS,
        "private": {"answer": "café ☕", "segments": [[1.5, 2.0]]},
    }
    assert Sample.from_json(line) == sample
    assert Sample.from_json(line.encode()) == sample


def test_from_json_defaults_and_errors():
    minimal = Sample.from_json(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    assert (minimal.id, minimal.tools, minimal.private) == (None, None, {})
    with pytest.raises(SampleError, match="not valid JSON"):
        Sample.from_json("{nope")
    with pytest.raises(SampleError, match="must be a JSON object, got list"):
        Sample.from_json("[]")
    with pytest.raises(SampleError, match="needs a 'messages' field"):
        Sample.from_json('{"id": "x"}')
    with pytest.raises(SampleError, match="unknown sample field.*'privat'"):
        Sample.from_json('{"messages": [{"role": "user", "content": "hi"}], "privat": {}}')


def test_to_json_refuses_what_json_cannot_carry():
    with pytest.raises(SampleError, match="sample 's1': cannot be written as JSON"):
        make(private={"answer": object()}).to_json()
    with pytest.raises(SampleError, match="cannot be written as JSON"):
        make(private={"score": float("nan")}).to_json()
