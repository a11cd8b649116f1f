"""Chat Completions on top of the engine's deltas: responses, stream chunks, logprobs, usage.

`prepare` reads an encoded request once into a `PreparedChat`: the sampling parameters (with the
grammar of a structured reply, areno/serve/structured.py), the tool parser when tools are in
play, the forced call opening of tool_choice "required" / named, and whether the reply starts
inside a reasoning block. Everything that reads the reply takes that
one bundle. Each choice's text is read in two steps: a reasoning block the prompt opened is split
off into `reasoning_content` (areno.tools.reasoning), then the rest is parsed for tool calls.

Pure functions of the request, the encoded prompt and the Generator's `RequestOutput`s, so the
HTTP layer (ingress.py) stays thin and these are unit-testable without Ray.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

from areno.engine.outputs import RequestOutput, SampleDelta
from areno.engine.sampling import SamplingParams
from areno.processing.types import PromptInputs
from areno.protocol import ChatCompletionRequest
from areno.protocol.chat import NamedToolChoice
from areno.protocol.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    DeltaMessage,
    PromptTokensDetails,
    ResponseMessage,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from areno.serve.structured import structured_output
from areno.tools import (
    ChoiceCall,
    ContentDelta,
    ParsedToolCalls,
    StreamEvent,
    ToolParser,
    choice_call,
)
from areno.tools.reasoning import THINK_END, ReasoningStream, opens_reasoning, split_reasoning


def tools_in_play(request: ChatCompletionRequest) -> bool:
    """Whether the model sees the request's tools and its output is parsed for calls."""
    return bool(request.tools) and request.tool_choice != "none"


def forced_choice(request: ChatCompletionRequest, parser: ToolParser | None) -> ChoiceCall | None:
    """The named forced call whose only freedom is one listed value (`choice_call`), or None:
    the server writes the rest of that call, the model samples only the value's telling part."""
    if parser is None or not tools_in_play(request):
        return None
    if not isinstance(request.tool_choice, NamedToolChoice):
        return None
    name = request.tool_choice.function.name
    [fn] = [tool.function for tool in request.tools or () if tool.function.name == name]
    return choice_call(parser, name, fn.parameters or {})


def forced_reply_prefix(request: ChatCompletionRequest, parser: ToolParser | None) -> str:
    """The call opening every choice is forced to start with: any call for tool_choice
    "required", a call of the named function for a named choice, "" otherwise. (The protocol
    layer already refused a named function that is not in `tools`, and "required" without
    tools.)"""
    if parser is None or not tools_in_play(request):
        return ""
    if request.tool_choice == "required":
        return parser.forced_prefix(None)
    if isinstance(request.tool_choice, NamedToolChoice):
        choice = forced_choice(request, parser)
        name = request.tool_choice.function.name
        return choice.before if choice is not None else parser.forced_prefix(name)
    return ""


def forced_prompt_text(prompt_text: str, reply_prefix: str) -> str:
    """The text appended to the rendered prompt to force `reply_prefix`. A generation prompt
    that opens a reasoning block (Qwen3.5 and thinking checkpoints end it with `<think>\n`) is
    closed first, as the template's enable_thinking=false form writes it: a forced call skips
    reasoning rather than starting inside it."""
    if opens_reasoning(prompt_text):
        return f"\n{THINK_END}\n\n" + reply_prefix
    return reply_prefix


def reasoning_in_play(prompt_text: str, reply_prefix: str) -> bool:
    """Whether each choice's text starts inside a reasoning block: the rendered prompt leaves
    one open and no forced call opening closes it first (forced_prompt_text)."""
    return not reply_prefix and opens_reasoning(prompt_text)


@dataclasses.dataclass(frozen=True)
class PreparedChat:
    """A request as the Generator runs it and as its reply is read: `inputs` is the encoded
    prompt with the forced call opening's tokens appended; `parser` is None unless tools are in
    play; `prefix` is the forced call opening ("" when none, see forced_reply_prefix); `thinking`
    says each choice's text starts inside a reasoning block (see reasoning_in_play); `choice`
    is the forced call whose rest the server writes (see forced_choice), None for any other."""

    request: ChatCompletionRequest
    params: SamplingParams
    inputs: PromptInputs
    parser: ToolParser | None = None
    prefix: str = ""
    thinking: bool = False
    choice: ChoiceCall | None = None

    def call_text(self, text: str) -> str:
        """A sample's text as its tool calls are read: the forced call opening first, and for a
        forced choice that the model made, the rest of the call after it."""
        whole = self.choice.complete(text) if self.choice is not None else None
        return whole if whole is not None else self.prefix + text


def prepare(
    request: ChatCompletionRequest,
    params: SamplingParams,
    encoded: PromptInputs,
    tool_parser: ToolParser,
    tokenizer: Any,
) -> PreparedChat:
    """The request's `PreparedChat`, from its sampling parameters, its encoded prompt and the
    model family's tool parser (used only when the request's tools are in play)."""
    parser = tool_parser if tools_in_play(request) else None
    prefix = forced_reply_prefix(request, parser)
    choice = forced_choice(request, parser)
    thinking = reasoning_in_play(encoded.prompt_text, prefix)
    structured = structured_output(request, parser, prefix, thinking, choice)
    if structured is not None:
        params = dataclasses.replace(params, structured=structured)
    if parser is not None or thinking:
        # Tool-call and reasoning tags may be special tokens: keep them in the text.
        params = dataclasses.replace(params, skip_special_tokens=False)
    inputs = _force_prefix(encoded, prefix, tokenizer)
    return PreparedChat(request, params, inputs, parser, prefix, thinking, choice)


def _force_prefix(inputs: PromptInputs, prefix: str, tokenizer: Any) -> PromptInputs:
    """The prompt followed by the forced call opening (tool_choice "required" or named):
    the model continues a call it cannot avoid, whose rest the grammar constrains."""
    if not prefix:
        return inputs
    text = forced_prompt_text(inputs.prompt_text, prefix)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return inputs.with_tokens(inputs.input_ids + ids)


def usage_for(
    inputs: PromptInputs, num_completion_tokens: int, num_cached_tokens: int = 0
) -> Usage:
    """Usage with the encoded prompt length. `prompt_tokens_details` carries the prompt tokens
    the prefix cache held (`cached_tokens`) and the media token counts (video frames count as
    image tokens), each where non-zero, and is left out when all are zero, as vLLM sends it. The
    openai client reads the missing field as None (an empty `{}` would parse as details with
    every count None)."""
    num_image = inputs.num_tokens("image") + inputs.num_tokens("video")
    num_audio = inputs.num_tokens("audio")
    details = None
    if num_image or num_audio or num_cached_tokens:
        details = PromptTokensDetails(
            cached_tokens=num_cached_tokens or None,
            image_tokens=num_image or None,
            audio_tokens=num_audio or None,
        )
    return Usage.from_counts(inputs.num_prompt_tokens, num_completion_tokens, details)


def logprobs_for(tokenizer: Any, delta: SampleDelta) -> ChoiceLogprobs | None:
    """OpenAI logprobs for a delta's tokens (None when the request did not ask)."""
    if delta.logprobs is None:
        return None
    tops = delta.top_logprobs or [[] for _ in delta.token_ids]
    content = [
        TokenLogprob(
            **_token(tokenizer, token_id, logprob),
            top_logprobs=[TopLogprob(**_token(tokenizer, t, lp)) for t, lp in top],
        )
        for token_id, logprob, top in zip(delta.token_ids, delta.logprobs, tops, strict=True)
    ]
    return ChoiceLogprobs(content=content)


def _token(tokenizer: Any, token_id: int, logprob: float) -> dict:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def parse_reply(prepared: PreparedChat, text: str) -> tuple[str, ParsedToolCalls]:
    """One sample's whole text as (reasoning, content and tool calls): with `thinking` (see
    reasoning_in_play) the reasoning block is split off first, so neither its text nor its end
    tag reaches content or the tool-call parser; with a `parser`, calls are read from the rest
    after the forced call opening `prefix` (see forced_reply_prefix)."""
    reasoning = ""
    if prepared.thinking:
        reasoning, text = split_reasoning(text)
    if prepared.parser is None:
        return reasoning, ParsedToolCalls(text)
    return reasoning, prepared.parser.parse(prepared.call_text(text), prepared.request.tools)


def build_response(
    prepared: PreparedChat, model: str, output: RequestOutput, tokenizer: Any
) -> tuple[ChatCompletionResponse, int]:
    """The non-streaming response from a request's merged output (one delta per sample), each
    sample's text read once by parse_reply, and how many of its tool-call texts did not parse
    (each came back as content)."""
    choices, num_malformed = [], 0
    for delta in output.samples:
        reasoning, parsed = parse_reply(prepared, delta.text)
        num_malformed += parsed.num_malformed
        # NOTE: "abort" is never rewritten to "stop" (an aborted reply must not look complete);
        # the Generator replica answers an aborted request with RequestAbortedError instead.
        finish_reason = delta.finish_reason or "stop"
        if parsed.tool_calls and (finish_reason == "stop" or _chose(prepared, delta.text)):
            finish_reason = "tool_calls"  # a forced choice's call is whole once chosen
        choices.append(
            Choice(
                index=delta.index,
                message=_message(prepared, reasoning, parsed),
                finish_reason=finish_reason,
                logprobs=logprobs_for(tokenizer, delta),
                token_ids=list(delta.token_ids) if prepared.request.return_token_ids else None,
            )
        )
    num_completion = sum(len(delta.token_ids) for delta in output.samples)
    usage = usage_for(prepared.inputs, num_completion, output.num_cached_tokens)
    response = ChatCompletionResponse(
        model=model, choices=choices, usage=usage, prompt_token_ids=_prompt_ids(prepared)
    )
    return response, num_malformed


def _chose(prepared: PreparedChat, text: str) -> bool:
    """Whether `text` is a forced choice's value: the server wrote the rest of its call, so
    the call is whole even where the sampling stopped at max_tokens right after the value."""
    return prepared.choice is not None and text in prepared.choice.choices


def _prompt_ids(prepared: PreparedChat) -> list[int] | None:
    """The prompt's ids as the engine ran them, where the request asks (`return_token_ids`)."""
    return list(prepared.inputs.input_ids) if prepared.request.return_token_ids else None


def _message(prepared: PreparedChat, reasoning: str, parsed: ParsedToolCalls) -> ResponseMessage:
    """A choice's message from its reasoning and its parsed content and calls."""
    content: str | None = parsed.content
    if prepared.parser is not None or prepared.thinking:
        # A reply of only calls / reasoning has null content.
        content = content or None
    return ResponseMessage(
        content=content, reasoning_content=reasoning or None, tool_calls=parsed.tool_calls
    )


class ChunkWriter:
    """Turns one request's stream of deltas into SSE lines of `chat.completion.chunk`s. With
    `thinking`, each choice's reasoning block streams as `delta.reasoning_content` until its end
    tag; with a `parser`, the rest goes through the choice's own tool-call stream parser, fed the
    forced call opening `prefix` first (so a forced call's deltas carry its name). It keeps what
    it wrote of each choice, for `summary`."""

    def __init__(self, prepared: PreparedChat, model: str, tokenizer: Any):
        self.prepared, self.model, self.tokenizer = prepared, model, tokenizer
        self.id = ChatCompletionResponse(model=model, choices=[]).id
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0  # the prompt tokens the prefix cache held, once admitted
        self._streams: dict[int, Any] = {}
        self._reasoning: dict[int, ReasoningStream] = {}
        # choice index -> its reasoning pieces and its content and call events, as written
        self._written: dict[int, tuple[list[str], list[StreamEvent]]] = {}
        self._finish_reasons: dict[int, str] = {}
        self._sent_prompt_ids = False
        self._chosen: dict[int, str] = {}  # choice index -> a forced choice's text so far

    def chunks(self, output: RequestOutput) -> Iterator[str]:
        """SSE lines for one step's deltas."""
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        for delta in output.samples:
            role = None if delta.index in self._written else "assistant"
            reasoning, content, calls, finish = self.read(delta)
            ids = list(delta.token_ids) if self.prepared.request.return_token_ids else None
            if not (role or reasoning or content or calls or finish or delta.logprobs or ids):
                continue
            choice = ChunkChoice(
                index=delta.index,
                delta=DeltaMessage(
                    role=role,
                    content=content or ("" if role and not (calls or reasoning) else None),
                    reasoning_content=reasoning or None,
                    tool_calls=calls or None,
                ),
                finish_reason=finish,
                logprobs=logprobs_for(self.tokenizer, delta),
                token_ids=ids,
            )
            chunk = ChatCompletionChunk(id=self.id, model=self.model, choices=[choice])
            if not self._sent_prompt_ids:
                chunk.prompt_token_ids = _prompt_ids(self.prepared)
                self._sent_prompt_ids = True
            yield self._line(chunk)

    def read(self, delta: SampleDelta) -> tuple[str, str, list[ToolCallDelta], str | None]:
        """What one choice's delta adds: (reasoning, content, tool-call deltas, finish reason
        or None), kept for `summary`. The Responses API's writer reads deltas through it too."""
        self.num_completion_tokens += len(delta.token_ids)
        self._written.setdefault(delta.index, ([], []))
        reasoning, content, calls = self._split(delta)
        finish = delta.finish_reason
        stream = self._streams.get(delta.index)
        if finish in ("stop", "length") and stream is not None and stream.num_calls:
            chose = _chose(self.prepared, self._chosen.get(delta.index, ""))
            finish = "tool_calls" if finish == "stop" or chose else finish
        self._keep(delta.index, reasoning, content, calls, finish)
        return reasoning, content, calls, finish

    @property
    def num_malformed_tool_calls(self) -> int:
        return sum(stream.num_malformed for stream in self._streams.values())

    def _keep(
        self,
        index: int,
        reasoning: str,
        content: str,
        calls: list[ToolCallDelta],
        finish: str | None,
    ) -> None:
        thoughts, events = self._written[index]
        if reasoning:
            thoughts.append(reasoning)
        if content:
            events.append(ContentDelta(content))
        events += calls
        if finish is not None:
            self._finish_reasons[index] = finish

    def _split(self, delta: SampleDelta) -> tuple[str, str, list[ToolCallDelta]]:
        """(reasoning, content, tool-call deltas) decided by one choice's delta."""
        reasoning, text = "", delta.text
        if self.prepared.thinking:
            thoughts = self._reasoning.setdefault(delta.index, ReasoningStream())
            reasoning, text = thoughts.feed(text)
            if delta.finish_reason is not None:
                reasoning += thoughts.finish()
        parser = self.prepared.parser
        if parser is None:
            return reasoning, text, []
        stream = self._streams.get(delta.index)
        if self.prepared.choice is not None:  # the call is read whole, once chosen
            tools = self.prepared.request.tools
            stream = stream or self._streams.setdefault(delta.index, parser.stream(tools))
            self._chosen[delta.index] = self._chosen.get(delta.index, "") + text
            text = ""
            if delta.finish_reason is not None:
                text = self.prepared.call_text(self._chosen[delta.index])
        elif stream is None:
            stream = self._streams[delta.index] = parser.stream(self.prepared.request.tools)
            text = self.prepared.prefix + text
        events = stream.feed(text)
        if delta.finish_reason is not None:
            events += stream.finish()
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        return reasoning, content, [e for e in events if not isinstance(e, ContentDelta)]

    def end(self) -> Iterator[str]:
        """The usage chunk (when asked for) and `[DONE]`."""
        if self.prepared.request.include_usage:
            usage = usage_for(
                self.prepared.inputs, self.num_completion_tokens, self.num_cached_tokens
            )
            yield self._line(ChatCompletionChunk(id=self.id, model=self.model, usage=usage))
        yield "data: [DONE]\n\n"

    def summary(self) -> ChatCompletionResponse:
        """What was streamed, as the same non-streaming reply without logprobs (for metrics
        and the completion log): each choice's events accumulated as a client does."""
        choices = [
            Choice(
                index=index,
                message=_message(
                    self.prepared, "".join(thoughts), ParsedToolCalls.from_events(events)
                ),
                finish_reason=self._finish_reasons.get(index) or "stop",
            )
            for index, (thoughts, events) in sorted(self._written.items())
        ]
        usage = usage_for(self.prepared.inputs, self.num_completion_tokens, self.num_cached_tokens)
        return ChatCompletionResponse(id=self.id, model=self.model, choices=choices, usage=usage)

    @staticmethod
    def failure(error: dict) -> Iterator[str]:
        """The stream's end after a failure once streaming began: an error event, no [DONE]
        (the openai client raises APIError on it)."""
        yield error_line(error)

    @staticmethod
    def _line(chunk: ChatCompletionChunk) -> str:
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


def error_line(error: dict) -> str:
    """An SSE line carrying an OpenAI error object (a failure after streaming began)."""
    return f"data: {json.dumps({'error': error})}\n\n"
