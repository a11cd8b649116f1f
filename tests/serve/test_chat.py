"""Responses and stream chunks built from engine outputs, tool calls, reasoning and usage
included, read back by the official `openai` types (no server needed: these are pure
functions)."""

from __future__ import annotations

import json

import pytest
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChunk
from transformers import AutoTokenizer

from areno.engine.outputs import RequestOutput, SampleDelta
from areno.processing.types import MediaSpan, PromptInputs
from areno.protocol import parse_chat_request
from areno.serve.chat import (
    ChunkWriter,
    build_response,
    forced_prompt_text,
    forced_reply_prefix,
    prepare,
    reasoning_in_play,
    tools_in_play,
    usage_for,
)
from areno.serve.sampling import sampling_params
from areno.tools import get_tool_parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL_TEXT = {
    "qwen3_xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>",
    "hermes_json": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>",
    "gemma4": '<|tool_call>call:get_weather{"city": "Paris"}<tool_call|>',
}


def request(**extra):
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS} | extra
    return parse_chat_request(body)


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path("qwen3_5"))


def prepared(chat, tokenizer, tool_format: str = "qwen3_xml", prompt_text: str = ""):
    """`chat` as the Ingress prepares it, over a five-token prompt rendered as `prompt_text`."""
    inputs = PromptInputs([1] * 5, {}, prompt_text=prompt_text)
    return prepare(chat, sampling_params(chat), inputs, get_tool_parser(tool_format), tokenizer)


def output(text: str, finish: str = "stop") -> RequestOutput:
    delta = SampleDelta(0, [1, 2], text=text, finish_reason=finish)
    return RequestOutput("r", [delta], num_prompt_tokens=5, finished=True)


@pytest.mark.parametrize("tool_format", sorted(CALL_TEXT))
def test_response_splits_tool_calls(tokenizer, tool_format):
    text = "Let me check. " + CALL_TEXT[tool_format]
    body, _ = build_response(
        prepared(request(), tokenizer, tool_format), "m", output(text), tokenizer
    )
    parsed = ChatCompletion.model_validate(body.model_dump(exclude_none=True))
    choice = parsed.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("tool_format", sorted(CALL_TEXT))
def test_stream_splits_tool_calls_across_deltas(tokenizer, tool_format):
    writer = ChunkWriter(prepared(request(stream=True), tokenizer, tool_format), "m", tokenizer)
    text = "Checking. " + CALL_TEXT[tool_format]
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    lines = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = SampleDelta(0, [7], text=piece, finish_reason="stop" if last else None)
        lines += writer.chunks(RequestOutput("r", [delta], finished=last))
    lines += writer.end()
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [OpenAIChunk.model_validate_json(line[6:]) for line in lines[:-1]]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert content == "Checking."
    assert calls[0].function.name == "get_weather" and calls[0].id
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_malformed_call_text_comes_back_as_content(tokenizer):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    body, num_malformed = build_response(
        prepared(request(), tokenizer, "hermes_json"), "m", output(text), tokenizer
    )
    assert num_malformed == 1
    assert body.choices[0].message.content == text
    assert body.choices[0].message.tool_calls == []
    assert body.choices[0].finish_reason == "stop"


def test_tool_choice_none_keeps_tools_out_of_play():
    assert tools_in_play(request())
    assert not tools_in_play(request(tool_choice="none"))
    assert not tools_in_play(parse_chat_request({"messages": [{"role": "user", "content": "x"}]}))


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_forced_prefix_follows_tool_choice():
    parser = get_tool_parser("hermes_json")
    assert forced_reply_prefix(request(), parser) == ""
    assert forced_reply_prefix(request(tool_choice="auto"), parser) == ""
    assert forced_reply_prefix(request(tool_choice="none"), parser) == ""
    assert forced_reply_prefix(request(tool_choice="required"), None) == ""
    assert forced_reply_prefix(request(tool_choice="required"), parser) == (
        parser.forced_prefix(None)
    )
    assert forced_reply_prefix(request(tool_choice=NAMED), parser) == (
        parser.forced_prefix("get_weather")
    )


def test_forced_call_closes_an_open_reasoning_block():
    assert forced_prompt_text("<|im_start|>assistant\n", "<tool_call>") == "<tool_call>"
    thinking = "<|im_start|>assistant\n<think>\n"
    assert forced_prompt_text(thinking, "<tool_call>") == "\n</think>\n\n<tool_call>"
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert forced_prompt_text(closed, "<tool_call>") == "<tool_call>"


def _forced_split(tool_format: str) -> tuple[str, str]:
    """The named-choice prefix of a format and the generated rest of CALL_TEXT after it."""
    prefix = get_tool_parser(tool_format).forced_prefix("get_weather")
    text = CALL_TEXT[tool_format]
    assert text.startswith(prefix)
    return prefix, text[len(prefix) :]


@pytest.mark.parametrize("tool_format", sorted(CALL_TEXT))
def test_forced_call_response_names_the_function(tokenizer, tool_format):
    """The engine generates only what follows the forced prefix; the response still holds the
    whole call."""
    prefix, generated = _forced_split(tool_format)
    chat = prepared(request(tool_choice=NAMED), tokenizer, tool_format)
    assert chat.prefix == prefix
    body, _ = build_response(chat, "m", output(generated), tokenizer)
    choice = ChatCompletion.model_validate(body.model_dump(exclude_none=True)).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )


@pytest.mark.parametrize("tool_format", sorted(CALL_TEXT))
def test_forced_call_streams_with_its_name(tokenizer, tool_format):
    _, generated = _forced_split(tool_format)
    chat = prepared(request(tool_choice=NAMED, stream=True, n=2), tokenizer, tool_format)
    writer = ChunkWriter(chat, "m", tokenizer)
    lines = []
    for i, char in enumerate(generated):
        last = i == len(generated) - 1
        deltas = [
            SampleDelta(k, [7], text=char, finish_reason="stop" if last else None) for k in (0, 1)
        ]
        lines += writer.chunks(RequestOutput("r", deltas, finished=last))
    chunks = [OpenAIChunk.model_validate_json(line[6:]) for line in lines]
    for index in (0, 1):
        choices = [c for chunk in chunks for c in chunk.choices if c.index == index]
        calls = [tc for c in choices for tc in c.delta.tool_calls or []]
        assert calls[0].function.name == "get_weather"
        assert "".join(c.delta.content or "" for c in choices) == ""
        assert choices[-1].finish_reason == "tool_calls"
    assert writer.num_malformed_tool_calls == 0


def test_unfinished_forced_call_is_content_with_its_prefix(tokenizer):
    prefix = get_tool_parser("gemma4").forced_prefix("get_weather")
    chat = prepared(request(tool_choice=NAMED), tokenizer, "gemma4")
    body, _ = build_response(chat, "m", output("{zq", "length"), tokenizer)
    assert body.choices[0].message.content == prefix + "{zq"
    assert not body.choices[0].message.tool_calls
    assert body.choices[0].finish_reason == "length"


THINKING_PROMPT = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_reasoning_is_in_play_only_inside_an_open_block_and_without_a_forced_call():
    assert reasoning_in_play(THINKING_PROMPT, "")
    assert not reasoning_in_play(THINKING_PROMPT, "<tool_call>")  # the forced call closes it
    assert not reasoning_in_play(THINKING_PROMPT + "\n</think>\n\n", "")  # enable_thinking=false
    assert not reasoning_in_play("<|im_start|>assistant\n", "")


def test_prepare_keeps_special_tokens_only_for_tool_calls_or_reasoning(tokenizer):
    """Their tags may be special tokens; any other request's text leaves special tokens out."""
    plain = prepared(request(tools=None), tokenizer)
    assert (plain.parser, plain.thinking, plain.params.skip_special_tokens) == (None, False, True)
    declined = prepared(request(tool_choice="none"), tokenizer)
    assert declined.parser is None and declined.params.skip_special_tokens
    assert not prepared(request(), tokenizer).params.skip_special_tokens
    thinking = prepared(request(tools=None), tokenizer, prompt_text=THINKING_PROMPT)
    assert thinking.thinking and not thinking.params.skip_special_tokens


def test_prepare_appends_the_forced_call_opening_to_the_prompt(tokenizer):
    auto = prepared(request(), tokenizer)
    assert auto.prefix == "" and auto.inputs.input_ids == [1] * 5
    forced = prepared(request(tool_choice=NAMED), tokenizer, prompt_text=THINKING_PROMPT)
    assert forced.prefix == get_tool_parser("qwen3_xml").forced_prefix("get_weather")
    assert not forced.thinking  # the forced call closes the open block first
    text = forced_prompt_text(THINKING_PROMPT, forced.prefix)
    assert forced.inputs.input_ids == [1] * 5 + tokenizer.encode(text, add_special_tokens=False)


def reasoning_of(message) -> str | None:
    """`reasoning_content` as the openai client exposes a field it does not declare."""
    extra = message.model_extra or {}
    assert getattr(message, "reasoning_content", None) == extra.get("reasoning_content")
    return extra.get("reasoning_content")


@pytest.mark.parametrize("with_tools", [False, True])
def test_response_splits_reasoning_from_content_and_calls(tokenizer, with_tools):
    chat = request() if with_tools else request(tools=None)
    reply = "Paris is asked.\n</think>\n\n" + ("Checking. " + CALL_TEXT["qwen3_xml"])
    chat = prepared(chat, tokenizer, prompt_text=THINKING_PROMPT)
    body, _ = build_response(chat, "m", output(reply), tokenizer)
    choice = ChatCompletion.model_validate(body.model_dump(exclude_none=True)).choices[0]
    assert reasoning_of(choice.message) == "Paris is asked."
    assert "think>" not in choice.message.content
    if with_tools:
        assert choice.message.content == "Checking."
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.message.content == "Checking. " + CALL_TEXT["qwen3_xml"]


def test_a_reasoning_block_never_closed_is_all_reasoning(tokenizer):
    chat = prepared(request(), tokenizer, prompt_text=THINKING_PROMPT)
    body, _ = build_response(
        chat, "m", output("Still weighing <tool_call> or not", "length"), tokenizer
    )
    choice = ChatCompletion.model_validate(body.model_dump(exclude_none=True)).choices[0]
    assert reasoning_of(choice.message) == "Still weighing <tool_call> or not"
    assert choice.message.content is None and not choice.message.tool_calls
    assert choice.finish_reason == "length"


def test_without_reasoning_in_play_nothing_is_reasoning(tokenizer):
    """enable_thinking=false, or a template without blocks: the text is all content."""
    text = "Plain </think> answer"
    body, _ = build_response(prepared(request(tools=None), tokenizer), "m", output(text), tokenizer)
    dumped = body.model_dump(exclude_none=True)
    assert "reasoning_content" not in dumped["choices"][0]["message"]
    assert dumped["choices"][0]["message"]["content"] == text


def stream_reply(writer: ChunkWriter, pieces: list[str], finish: str = "stop") -> list[OpenAIChunk]:
    lines = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = SampleDelta(0, [7], text=piece, finish_reason=finish if last else None)
        lines += writer.chunks(RequestOutput("r", [delta], finished=last))
    lines += writer.end()
    assert lines[-1] == "data: [DONE]\n\n"
    return [OpenAIChunk.model_validate_json(line[6:]) for line in lines[:-1]]


def test_stream_sends_reasoning_deltas_until_the_end_tag_then_content_and_calls(tokenizer):
    """Token by token, with `</think>` split across deltas: reasoning deltas first, then content
    and tool-call deltas, as the non-streaming response holds them."""
    reply = "Paris is asked.\n</think>\n\nChecking. " + CALL_TEXT["qwen3_xml"]
    cut = reply.index("</think>") + 3
    pieces = [reply[:cut], *reply[cut:]]  # "...</th" then one character at a time
    chat = prepared(request(stream=True), tokenizer, prompt_text=THINKING_PROMPT)
    writer = ChunkWriter(chat, "m", tokenizer)
    chunks = stream_reply(writer, pieces)
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(reasoning_of(d) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert (reasoning, content) == ("Paris is asked.", "Checking.")
    assert calls[0].function.name == "get_weather"
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(reasoning_of(d) is None for d in deltas[first_content:])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("reply", ["Paris is asked.\n</think>\n\nChecking. ", "Still weighing"])
def test_a_stream_summary_holds_what_the_whole_reply_holds(tokenizer, reply):
    """The metrics and the completion log of a streamed reply read what the writer wrote
    (never a second parse of the merged text), and that is the non-streaming reply's message:
    reasoning, content, calls and finish reason."""
    reply += CALL_TEXT["qwen3_xml"] + " and <tool_call>{broken</tool_call>"
    whole, num_malformed = build_response(
        prepared(request(), tokenizer, prompt_text=THINKING_PROMPT), "m", output(reply), tokenizer
    )
    chat = prepared(request(stream=True), tokenizer, prompt_text=THINKING_PROMPT)
    writer = ChunkWriter(chat, "m", tokenizer)
    stream_reply(writer, list(reply))
    summary = writer.summary()
    assert summary.id == writer.id
    assert summary.usage.completion_tokens == len(reply)
    [streamed], [expected] = summary.choices, whole.choices
    assert streamed.finish_reason == expected.finish_reason
    message, expected_message = streamed.message, expected.message
    assert (message.content, message.reasoning_content) == (
        expected_message.content,
        expected_message.reasoning_content,
    )
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert calls == [(c.function.name, c.function.arguments) for c in expected_message.tool_calls]
    assert writer.num_malformed_tool_calls == num_malformed


def test_stream_of_a_block_never_closed_has_no_content(tokenizer):
    chat = prepared(request(stream=True, tools=None), tokenizer, prompt_text=THINKING_PROMPT)
    writer = ChunkWriter(chat, "m", tokenizer)
    chunks = stream_reply(writer, list("Still thinking\n</thi"), finish="length")
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(reasoning_of(d) or "" for d in deltas) == "Still thinking\n</thi"
    assert not any(d.content for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_usage_leaves_prompt_tokens_details_out_without_media():
    """As vLLM does (details only for a non-zero cached count; AReno has no prompt cache): no
    `{}` the client would read as details with every count None."""
    usage = usage_for(PromptInputs([1] * 5, {}), 3)
    dumped = usage.model_dump(exclude_none=True)
    assert dumped == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert CompletionUsage.model_validate(dumped).prompt_tokens_details is None


def test_usage_reports_media_tokens_per_modality():
    spans = [
        MediaSpan("image", 0, 1, 6, 4, "a"),
        MediaSpan("video", 1, 6, 14, 6, "b"),
        MediaSpan("audio", 2, 14, 19, 3, "c"),
    ]
    usage = usage_for(PromptInputs([1] * 20, {}, spans), 2)
    details = CompletionUsage.model_validate(usage.model_dump(exclude_none=True))
    details = details.prompt_tokens_details
    assert (details.image_tokens, details.audio_tokens) == (10, 3)  # video frames are images
    assert details.cached_tokens is None
