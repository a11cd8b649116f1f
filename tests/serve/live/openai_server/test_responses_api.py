"""The Responses API on the open Gemma 4 app, through the official `openai` client's
`responses.create` and `responses.stream`: text with instructions and its usage, an image and
audio, streaming against the whole reply, a JSON-schema `text.format`, a two-turn tool loop that
sends the first reply's output items back with a `function_call_output`, and refusals that name
the field (the server is stateless)."""

from __future__ import annotations

import base64
import json

import jsonschema
import openai
import pytest

from tests.serve.live.apps import PET_SCHEMA
from tests.serve.live.openai_server.test_tools_and_logging import STRICT_PAN

PAN = {"type": "function"} | {
    key: value for key, value in STRICT_PAN["function"].items() if key != "type"
}


def respond(client, input, **kwargs):
    return client.responses.create(
        model=kwargs.pop("model", "tiny-gemma4"),
        input=input,
        max_output_tokens=kwargs.pop("max_output_tokens", 8),
        temperature=kwargs.pop("temperature", 0),
        **kwargs,
    )


def test_a_text_reply_with_instructions_and_usage(server):
    plain = respond(server, "Hello there!")
    instructed = respond(server, "Hello there!", instructions="Answer in French.")
    assert plain.id.startswith("resp_") and plain.model == "tiny-gemma4"
    assert plain.status in {"completed", "incomplete"}
    assert isinstance(plain.output_text, str) and plain.output[0].type == "message"
    usage = plain.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 < usage.output_tokens <= 8
    assert instructed.usage.input_tokens > usage.input_tokens  # the system message
    assert instructed.instructions == "Answer in French."


def test_an_image_and_audio(server, media):
    with open(media["image"], "rb") as f:
        image_data_url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    with open(media["audio"], "rb") as f:
        audio_b64 = base64.b64encode(f.read()).decode()
    text = [{"type": "input_text", "text": "What do you see and hear?"}]

    def input_tokens(*parts) -> int:
        response = respond(server, [{"role": "user", "content": [*parts, *text]}])
        assert response.status in {"completed", "incomplete"}
        return response.usage.input_tokens

    without = input_tokens()
    image = input_tokens({"type": "input_image", "image_url": media["image"], "detail": "auto"})
    assert image > without
    assert input_tokens({"type": "input_image", "image_url": image_data_url}) == image
    audio = input_tokens(
        {"type": "input_audio", "input_audio": {"data": audio_b64, "format": "wav"}}
    )
    assert audio > without


def test_streaming_matches_the_whole_reply(server, media):
    content = [
        {"type": "input_image", "image_url": media["image"], "detail": "auto"},
        {"type": "input_text", "text": "Describe it."},
    ]
    input = [{"role": "user", "content": content}]
    whole = respond(server, input, max_output_tokens=12)
    events = list(respond(server, input, max_output_tokens=12, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == f"response.{whole.status}"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed, usage = events[-1].response.usage, whole.usage  # the cache's hits grow, no more
    assert (streamed.input_tokens, streamed.output_tokens, streamed.total_tokens) == (
        usage.input_tokens, usage.output_tokens, usage.total_tokens)  # fmt: skip
    assert streamed.input_tokens_details.cached_tokens >= usage.input_tokens_details.cached_tokens


def test_a_json_schema_text_format_streams_a_reply_that_validates(server):
    """Random weights: only the grammar makes the reply parse."""
    text = {"format": {"type": "json_schema", "name": "pet", "schema": PET_SCHEMA}}
    with server.responses.stream(
        model="tiny-gemma4", input="Name a pet.", text=text, temperature=1.0,
        max_output_tokens=48, extra_body={"seed": 2},
    ) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text
    jsonschema.validate(json.loads(final.output_text), PET_SCHEMA)
    assert final.text.format.type == "json_schema"


def test_a_two_turn_tool_loop(server):
    """The first reply's function call goes back with its output; the second turn's prompt
    holds both (more input tokens) and the model answers on."""
    question = [{"role": "user", "content": "Pan."}]
    first = respond(server, question, tools=[PAN], tool_choice="required", max_output_tokens=64)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "pan" and first.status == "completed"
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, STRICT_PAN["function"]["parameters"])

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "panned left"}
    second = respond(server, [*question, *first.output, result], tools=[PAN])
    assert second.status in {"completed", "incomplete"}
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_a_streamed_tool_call(server):
    with server.responses.stream(
        model="tiny-gemma4", input="Pan.", tools=[PAN], tool_choice="required",
        max_output_tokens=64, temperature=0,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    [call] = final.output
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert call.type == "function_call" and arguments == call.arguments
    jsonschema.validate(json.loads(arguments), STRICT_PAN["function"]["parameters"])
    [done] = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.call_id == call.call_id


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"store": True}, "store", "stateless"),
        ({"previous_response_id": "resp_123"}, "previous_response_id", "stateless"),
        ({"extra_body": {"n": 2}}, "n", "Unknown field"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "function"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "enable_thinking"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_url": "x"}]}]},
            "input[0].content[0].type",
            "input_file",
        ),
    ],
)
def test_what_is_not_supported_is_a_400_naming_the_field(server, kwargs, param, words):
    kwargs = {"input": "Hi."} | kwargs
    with pytest.raises(openai.BadRequestError) as caught:
        respond(server, kwargs.pop("input"), **kwargs)
    assert caught.value.param == param
    assert words in caught.value.message
    assert respond(server, "Still serving?").status in {"completed", "incomplete"}
