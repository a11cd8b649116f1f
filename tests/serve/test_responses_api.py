"""Responses API replies and event streams built from engine outputs (reasoning, text, tool
calls, logprobs, the token limit, a failure), read back by the official `openai` client over a
mock HTTP transport: `responses.create` parses the reply, `responses.stream` accumulates the
events into its final response, and each event validates against its own openai type (no
server needed: these are pure functions)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from transformers import AutoTokenizer

from areno.engine.outputs import RequestOutput, SampleDelta
from areno.processing.types import PromptInputs
from areno.protocol.responses_api import parse_responses_request, to_chat_request
from areno.serve.chat import build_response, prepare
from areno.serve.responses_api import ResponseEventWriter, build_reply
from areno.serve.sampling import sampling_params
from areno.tools import get_tool_parser

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>"
)
THINKING_PROMPT = "<|im_start|>assistant\n<think>\n"
EVENT_TYPES = {
    cls.model_fields["type"].annotation.__args__[0]: cls
    for cls in ResponseStreamEvent.__origin__.__args__
}


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path("qwen3_5"))


def prepared(body: dict, tokenizer, prompt_text: str = ""):
    request = parse_responses_request({"input": "Weather?"} | body)
    chat = to_chat_request(request)
    inputs = PromptInputs([1] * 5, {}, prompt_text=prompt_text)
    parser = get_tool_parser("qwen3_xml")
    return request, prepare(chat, sampling_params(chat), inputs, parser, tokenizer)


def deltas(pieces: list[str], finish: str = "stop", logprobs: bool = False) -> list[RequestOutput]:
    outputs = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = SampleDelta(
            0,
            [10 + i],
            text=text,
            finish_reason=finish if last else None,
            logprobs=[-0.5] if logprobs else None,
            top_logprobs=[[(10 + i, -0.5)]] if logprobs else None,
        )
        outputs.append(RequestOutput("r", [delta], num_prompt_tokens=5, finished=last))
    return outputs


def merged(pieces: list[str], finish: str = "stop", logprobs: bool = False) -> RequestOutput:
    steps = deltas(pieces, finish, logprobs)
    token_ids = [t for step in steps for t in step.samples[0].token_ids]
    delta = SampleDelta(
        0,
        token_ids,
        text="".join(pieces),
        finish_reason=finish,
        logprobs=[-0.5] * len(token_ids) if logprobs else None,
        top_logprobs=[[(t, -0.5)] for t in token_ids] if logprobs else None,
    )
    return RequestOutput("r", [delta], num_prompt_tokens=5, finished=True)


def client_for(body: bytes, content_type: str) -> openai.OpenAI:
    """An openai client whose every request is answered with `body`."""
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, content=body, headers={"content-type": content_type})
    )
    return openai.OpenAI(
        base_url="http://areno.test/v1", api_key="x", http_client=httpx.Client(transport=transport)
    )


def reply(body: dict, tokenizer, pieces, finish="stop", prompt_text="", logprobs=False):
    """The non-streaming reply as the openai client reads it, and its JSON."""
    request, ready = prepared(body, tokenizer, prompt_text)
    chat, _ = build_response(ready, "m", merged(pieces, finish, logprobs), tokenizer)
    data = build_reply(request, chat, "m", tokenizer).model_dump(mode="json", by_alias=True)
    Response.model_validate(data)  # strict: every field of OpenAI's schema
    client = client_for(json.dumps(data).encode(), "application/json")
    return client.responses.create(model="m", input="Weather?"), data


def streamed(body: dict, tokenizer, pieces, finish="stop", prompt_text="", logprobs=False):
    """The events as written, each validated as its openai type, and the openai stream
    helper's final response."""
    request, ready = prepared(body | {"stream": True}, tokenizer, prompt_text)
    writer = ResponseEventWriter(request, ready, "m", tokenizer)
    lines = [line for output in deltas(pieces, finish, logprobs) for line in writer.chunks(output)]
    lines += list(writer.end())
    events = []
    for line in lines:
        head, data = line.removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(EVENT_TYPES[event["type"]].model_validate(event))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    client = client_for("".join(lines).encode(), "text/event-stream")
    with client.responses.stream(model="m", input="Weather?") as stream:
        assert [e.type for e in stream] == [e.type for e in events]
        final = stream.get_final_response() if events[-1].type == "response.completed" else None
    return events, final, writer


def test_a_text_reply(tokenizer):
    response, data = reply({"instructions": "Be brief."}, tokenizer, ["Sunny", " today."])
    assert response.output_text == "Sunny today." and response.status == "completed"
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert response.usage.input_tokens == 5 and response.usage.output_tokens == 2
    assert response.usage.total_tokens == 7 and response.instructions == "Be brief."
    assert data["store"] is False and data["previous_response_id"] is None


def test_reasoning_then_a_tool_call(tokenizer):
    pieces = ["Think", " hard.</think>", "\n\nChecking. ", CALL[:20], CALL[20:]]
    body = {"tools": [TOOL], "parallel_tool_calls": True}
    response, data = reply(body, tokenizer, pieces, prompt_text=THINKING_PROMPT)
    reasoning, message, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Think hard."
    assert message.content[0].text == "Checking."
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "get_weather",
        {"city": "Paris"},
    )
    assert call.call_id.startswith("call_") and response.status == "completed"
    assert response.tools[0].name == "get_weather"
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= 5


def test_only_a_call_has_no_message(tokenizer):
    response, _ = reply({"tools": [TOOL]}, tokenizer, [CALL])
    assert [item.type for item in response.output] == ["function_call"]


def test_the_token_limit_makes_an_incomplete_reply(tokenizer):
    response, _ = reply({"max_output_tokens": 2}, tokenizer, ["Sun", "ny"], finish="length")
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.max_output_tokens == 2


def test_logprobs_when_included(tokenizer):
    body = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}
    response, _ = reply(body, tokenizer, ["Sun", "ny"], logprobs=True)
    logprobs = response.output[0].content[0].logprobs
    assert [entry.logprob for entry in logprobs] == [-0.5, -0.5]
    assert len(logprobs[0].top_logprobs) == 1 and response.top_logprobs == 1


def test_a_json_schema_format_is_echoed(tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = {"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}}
    response, _ = reply({"text": text}, tokenizer, ['{"a": 1}'])
    assert response.text.format.type == "json_schema" and response.text.format.schema_ == schema
    assert json.loads(response.output_text) == {"a": 1}


def test_stream_events_accumulate_into_the_unary_reply(tokenizer):
    pieces = ["Think", " hard.</think>", "\n\nChecking. ", CALL[:20], CALL[20:]]
    body = {"tools": [TOOL]}
    events, final, _ = streamed(body, tokenizer, pieces, prompt_text=THINKING_PROMPT)
    unary, _ = reply(body, tokenizer, pieces, prompt_text=THINKING_PROMPT)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == 3
    assert kinds.count("response.output_item.done") == 3
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
    assert "response.function_call_arguments.delta" in kinds
    assert [item.type for item in final.output] == [item.type for item in unary.output]
    assert final.output[0].content[0].text == "Think hard."
    assert final.output_text == unary.output_text == "Checking."
    assert final.output[2].arguments == unary.output[2].arguments
    assert final.usage == unary.usage
    # The ids of the events are the final response's.
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.id for item in added] == [item.id for item in final.output]


def test_a_streamed_text_reply(tokenizer):
    events, final, _ = streamed({}, tokenizer, ["Sun", "ny."], logprobs=True)
    deltas_ = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas_ == ["Sun", "ny."] and final.output_text == "Sunny."
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == "Sunny."


def test_a_streamed_reply_at_the_token_limit_is_incomplete(tokenizer):
    events, final, _ = streamed({}, tokenizer, ["Sun", "ny"], finish="length")
    assert final is None and events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output[0].content[0].text == "Sunny"


def test_an_empty_streamed_reply_is_one_empty_message(tokenizer):
    events, final, _ = streamed({}, tokenizer, [""])
    assert [item.type for item in final.output] == ["message"] and final.output_text == ""


def test_a_failure_after_streaming_began(tokenizer):
    request, ready = prepared({"stream": True}, tokenizer)
    writer = ResponseEventWriter(request, ready, "m", tokenizer)
    lines = list(writer.chunks(deltas(["Sun"], finish=None)[0]))
    error = {"message": "engine failed", "type": "server_error", "code": "request_aborted"}
    lines += list(writer.failure(error))
    events = [json.loads(line.split("data: ", 1)[1]) for line in lines]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    for event in events:
        EVENT_TYPES[event["type"]].model_validate(event)
    assert events[-1]["response"]["error"]["message"] == "engine failed"
