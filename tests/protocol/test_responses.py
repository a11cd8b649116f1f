"""Responses and stream chunks as the official `openai` client parses them."""

from __future__ import annotations

import json

import httpx2 as httpx
import openai
import pytest
from openai.types import Model
from openai.types.chat import ChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChunk

from areno.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionChoice,
    DeltaMessage,
    ErrorResponse,
    FunctionCall,
    FunctionCallDelta,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    RequestValidationError,
    ResponseMessage,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
    new_completion_id,
    new_tool_call_id,
    parse_chat_request,
)


def logprobs() -> ChoiceLogprobs:
    top = [
        TopLogprob(token="Hi", logprob=-0.1, bytes=[72, 105]),
        TopLogprob(token="Yo", logprob=-3),
    ]
    return ChoiceLogprobs(
        content=[TokenLogprob(token="Hi", logprob=-0.1, bytes=[72, 105], top_logprobs=top)]
    )


def completion() -> ChatCompletionResponse:
    call = ToolCall(function=FunctionCall(name="lookup", arguments='{"q": "cat"}'))
    message = ResponseMessage(content="Hi", reasoning_content="think", tool_calls=[call])
    usage = Usage.from_counts(300, 7, PromptTokensDetails(image_tokens=256, text_tokens=44))
    choice = Choice(index=0, message=message, finish_reason="tool_calls", logprobs=logprobs())
    return ChatCompletionResponse(model="m", choices=[choice], usage=usage)


def stream_chunks() -> list[ChatCompletionChunk]:
    cid = new_completion_id()

    def chunk(**choice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=cid, model="m", choices=[ChunkChoice(index=0, **choice)])

    call_id = new_tool_call_id()
    return [
        chunk(delta=DeltaMessage(role="assistant", content="")),
        chunk(delta=DeltaMessage(reasoning_content="hm")),
        chunk(delta=DeltaMessage(content="Hi"), logprobs=logprobs()),
        chunk(
            delta=DeltaMessage(
                tool_calls=[
                    ToolCallDelta(
                        index=0,
                        id=call_id,
                        type="function",
                        function=FunctionCallDelta(name="lookup", arguments=""),
                    )
                ]
            )
        ),
        chunk(
            delta=DeltaMessage(
                tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments='{"q"'))]
            )
        ),
        chunk(
            delta=DeltaMessage(
                tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments=": 1}"))]
            )
        ),
        chunk(finish_reason="tool_calls"),
        ChatCompletionChunk(id=cid, model="m", usage=Usage.from_counts(10, 5)),
    ]


@pytest.mark.parametrize("exclude_none", [False, True])
def test_completion_parses_with_openai_types(exclude_none):
    ours = completion()
    theirs = ChatCompletion.model_validate(ours.model_dump(exclude_none=exclude_none))
    assert theirs.id.startswith("chatcmpl-") and theirs.object == "chat.completion"
    choice = theirs.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Hi"
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and len(call.id) == 29
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"q": "cat"})
    assert choice.logprobs.content[0].top_logprobs[1].token == "Yo"
    assert choice.logprobs.content[0].bytes == [72, 105]
    assert choice.message.reasoning_content == "think"  # kept as an extra field
    usage = theirs.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (300, 7, 307)
    assert usage.prompt_tokens_details.image_tokens == 256


@pytest.mark.parametrize("exclude_none", [False, True])
def test_chunks_parse_with_openai_types(exclude_none):
    parsed = [
        OpenAIChunk.model_validate(c.model_dump(exclude_none=exclude_none)) for c in stream_chunks()
    ]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[2].choices[0].delta.content == "Hi"
    assert parsed[2].choices[0].logprobs.content[0].logprob == -0.1
    first_call = parsed[3].choices[0].delta.tool_calls[0]
    assert (first_call.index, first_call.type, first_call.function.name) == (
        0,
        "function",
        "lookup",
    )
    arguments = "".join(c.choices[0].delta.tool_calls[0].function.arguments for c in parsed[3:6])
    assert json.loads(arguments) == {"q": 1}
    assert parsed[6].choices[0].finish_reason == "tool_calls"
    assert parsed[7].choices == [] and parsed[7].usage.total_tokens == 15
    assert len({c.id for c in parsed}) == 1


def test_fields_the_schema_requires_are_present_and_null_in_compact_dumps():
    """A reply that is all reasoning (or only tool calls) has `content` null, not missing; a
    choice without logprobs has `logprobs` null; a chunk before a choice's end has
    `finish_reason` null; a text completion's choice both. Clients index them."""
    reasoning = ChatCompletionResponse(
        model="m",
        choices=[
            Choice(
                index=0, message=ResponseMessage(reasoning_content="hmm"), finish_reason="length"
            )
        ],
    ).model_dump(exclude_none=True)
    choice = reasoning["choices"][0]
    assert choice["message"]["content"] is None and choice["logprobs"] is None
    assert list(choice["message"])[:2] == ["role", "content"]
    assert "reasoning_content" in choice["message"]
    assert ChatCompletion.model_validate(reasoning).choices[0].message.content is None
    chunk = ChatCompletionChunk(
        id="c", model="m", choices=[ChunkChoice(index=0, delta=DeltaMessage(content="a"))]
    )
    sent = json.loads(chunk.model_dump_json(exclude_none=True))
    assert sent["choices"][0]["finish_reason"] is None and "logprobs" not in sent["choices"][0]
    text = CompletionChoice(index=0, text="a").model_dump(exclude_none=True)
    assert text == {"index": 0, "text": "a", "logprobs": None, "finish_reason": None}


def test_model_list_parses_with_openai_types():
    listing = ModelList(data=[ModelCard(id="qwen-vl", root="/ckpt", max_model_len=8192)])
    dumped = listing.model_dump()
    assert dumped["object"] == "list"
    model = Model.model_validate(dumped["data"][0])
    assert (model.id, model.object, model.owned_by) == ("qwen-vl", "model", "areno")


def test_abort_is_an_extension_reason():
    choice = Choice(index=0, message=ResponseMessage(content="x"), finish_reason="abort")
    assert choice.finish_reason == "abort"


# --- the official client over a mock transport --------------------------------------------------


def client_for(handler) -> openai.OpenAI:
    transport = httpx.MockTransport(handler)
    return openai.OpenAI(
        base_url="http://areno.test/v1",
        api_key="unused",
        http_client=httpx.Client(transport=transport),
        max_retries=0,
    )


def test_official_client_round_trip():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["request"] = parse_chat_request(request.content)
        return httpx.Response(200, json=completion().model_dump())

    response = client_for(handler).chat.completions.create(
        model="multimodal-model",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "/data/example.png"}},
                    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "mp3"}},
                    {"type": "text", "text": "Describe this image."},
                ],
            }
        ],
        tools=[
            {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
        ],
        tool_choice="auto",
        max_completion_tokens=64,
        logprobs=True,
        top_logprobs=2,
        extra_body={"top_k": 20, "chat_template_kwargs": {"enable_thinking": False}},
    )
    request = seen["request"]
    assert [p.media_url for _, p in request.media_parts()] == [
        "/data/example.png",
        "data:audio/mpeg;base64,AAAA",
    ]
    assert (request.max_new_tokens, request.top_k, request.top_logprobs) == (64, 20, 2)
    assert request.chat_template_kwargs == {"enable_thinking": False}
    assert response.choices[0].message.tool_calls[0].function.name == "lookup"


def test_official_client_stream():
    def handler(request: httpx.Request) -> httpx.Response:
        assert parse_chat_request(request.content).include_usage
        events = [f"data: {c.model_dump_json(exclude_none=True)}\n\n" for c in stream_chunks()]
        text = "".join(events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    stream = client_for(handler).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi"
    assert chunks[-1].usage.completion_tokens == 5


def test_official_client_sees_validation_error():
    def handler(request: httpx.Request) -> httpx.Response:
        try:
            parse_chat_request(request.content)
        except RequestValidationError as exc:
            return httpx.Response(exc.status_code, json=ErrorResponse.from_error(exc).model_dump())
        raise AssertionError("the request should not parse")

    with pytest.raises(openai.BadRequestError) as info:
        client_for(handler).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        )
    assert info.value.code == "invalid_request"
    assert info.value.param == "messages[0].content[0].image_url.url"
