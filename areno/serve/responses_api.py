"""The Responses API on top of the chat path: a reply, or its stream of typed events.

The Ingress serves a `ResponsesRequest` as the `ChatCompletionRequest` it translates into
(areno/protocol/responses_api.py): the same encoding, `prepare`, Generator call, reasoning split
and tool-call parsing. What differs is the reply's shape, built here from what the chat path
reads: `build_reply` turns the chat reply into output items (reasoning, a message with its
output text, function calls) and usage; `ResponseEventWriter` reads the engine's deltas through a
`ChunkWriter` and writes the typed SSE events (`response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ...,
`response.completed` or `response.incomplete`), each with its `sequence_number`.

Pure functions of the request and the Generator's outputs, unit-testable without Ray.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from areno.engine.outputs import RequestOutput
from areno.protocol.responses import ChatCompletionResponse, ChoiceLogprobs, Usage
from areno.protocol.responses_api import ResponsesRequest
from areno.protocol.responses_reply import (
    FunctionCall,
    IncompleteDetails,
    Logprob,
    OutputMessage,
    OutputTextPart,
    Reasoning,
    ReasoningOutputText,
    ResponseError,
    ResponseObject,
    ResponsesUsage,
    TopLogprob,
)
from areno.serve.chat import ChunkWriter, PreparedChat, logprobs_for


def responses_logprobs(logprobs: ChoiceLogprobs | None) -> list[Logprob]:
    """Chat logprobs as the Responses API's (every token's bytes given)."""
    return [
        Logprob(
            token=entry.token,
            bytes=entry.bytes or [],
            logprob=entry.logprob,
            top_logprobs=[
                TopLogprob(token=top.token, bytes=top.bytes or [], logprob=top.logprob)
                for top in entry.top_logprobs
            ],
        )
        for entry in (logprobs.content or [] if logprobs is not None else [])
    ]


def responses_usage(usage: Usage, reasoning: str, tokenizer: Any) -> ResponsesUsage:
    """The chat usage as the Responses API's (the prefix cache's hits as `cached_tokens`);
    reasoning tokens are the reasoning text's count re-encoded (the engine does not tag tokens
    by block)."""
    num_reasoning = len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return ResponsesUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details={"cached_tokens": cached},
        output_tokens=usage.completion_tokens,
        output_tokens_details={"reasoning_tokens": min(num_reasoning, usage.completion_tokens)},
        total_tokens=usage.total_tokens,
    )


def _finish(response: ResponseObject, finish_reason: str | None) -> None:
    if finish_reason == "length":
        response.status = "incomplete"
        response.incomplete_details = IncompleteDetails()
    else:
        response.status = "completed"


def build_reply(
    request: ResponsesRequest, chat: ChatCompletionResponse, model: str, tokenizer: Any
) -> ResponseObject:
    """The non-streaming reply from the chat path's reply to the translated request: its
    reasoning, then its text as a message (an empty one when the reply holds nothing at all),
    then its function calls. A reply of only reasoning or calls has no message."""
    response = ResponseObject.for_request(request, model)
    [choice] = chat.choices
    message = choice.message
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    if message.reasoning_content:
        text = ReasoningOutputText(text=message.reasoning_content)
        response.output.append(Reasoning(content=[text], status=status))
    if message.content or not (message.tool_calls or message.reasoning_content):
        part = OutputTextPart(
            text=message.content or "", logprobs=responses_logprobs(choice.logprobs)
        )
        response.output.append(OutputMessage(content=[part], status=status))
    response.output += [
        FunctionCall(call_id=call.id, name=call.function.name, arguments=call.function.arguments)
        for call in message.tool_calls
    ]
    response.usage = responses_usage(chat.usage, message.reasoning_content or "", tokenizer)
    _finish(response, choice.finish_reason)
    return response


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True)


class ResponseEventWriter:
    """Turns one request's stream of deltas into the Responses API's SSE events. Output items
    open and close as the reply moves between reasoning, text and calls: a new kind of content
    (or a new call) closes the open item with its `.done` events. The final
    `response.completed` (or `response.incomplete` at the token limit) holds every item, with
    the same ids as their events, and the usage.

    It offers what the Ingress's SSE loop reads of a chat ChunkWriter: `chunks`, `end`,
    `failure`, `summary` (the chat reply, for metrics and the completion log), `prepared` and
    `num_malformed_tool_calls`."""

    def __init__(
        self, request: ResponsesRequest, prepared: PreparedChat, model: str, tokenizer: Any
    ):
        self.request, self.tokenizer = request, tokenizer
        self.chat = ChunkWriter(prepared, model, tokenizer)
        self.response = ResponseObject.for_request(request, model)
        self.sequence_number = 0
        self.finish_reason: str | None = None
        self._open: Any = None  # the output item being written, if any
        self._calls: dict[int, FunctionCall] = {}  # tool-call index -> its item
        self._started = False

    @property
    def prepared(self) -> PreparedChat:
        return self.chat.prepared

    @property
    def num_malformed_tool_calls(self) -> int:
        return self.chat.num_malformed_tool_calls

    def chunks(self, output: RequestOutput) -> Iterator[str]:
        """SSE events for one step's deltas (the lifecycle's opening events first)."""
        if not self._started:
            self._started = True
            yield self._event("response.created", response=_dump(self.response))
            yield self._event("response.in_progress", response=_dump(self.response))
        for delta in output.samples:
            reasoning, content, calls, finish = self.chat.read(delta)
            if reasoning:
                yield from self._reasoning(reasoning)
            if content:
                logprobs = logprobs_for(self.tokenizer, delta)
                yield from self._text(content, responses_logprobs(logprobs))
            for call in calls:
                yield from self._call(call)
            self.finish_reason = finish or self.finish_reason

    def end(self) -> Iterator[str]:
        """The open item's closing events and `response.completed` / `response.incomplete`."""
        if not self.response.output:
            yield from self._text("", [])  # a reply with nothing in it is one empty message
        yield from self._close()
        summary = self.chat.summary()
        reasoning = summary.choices[0].message.reasoning_content if summary.choices else None
        self.response.usage = responses_usage(summary.usage, reasoning or "", self.tokenizer)
        _finish(self.response, self.finish_reason)
        yield self._event(f"response.{self.response.status}", response=_dump(self.response))

    def failure(self, error: dict) -> Iterator[str]:
        """An `error` event and `response.failed`, for a failure once streaming began."""
        fields = {key: error.get(key) for key in ("code", "message", "param")}
        yield self._event("error", **fields)
        self.response.status = "failed"
        self.response.error = ResponseError(message=error.get("message", "server error"))
        yield self._event("response.failed", response=_dump(self.response))

    def summary(self) -> ChatCompletionResponse:
        return self.chat.summary()

    def _reasoning(self, text: str) -> Iterator[str]:
        if not isinstance(self._open, Reasoning):
            yield from self._add(Reasoning(status="in_progress"), ReasoningOutputText())
        item = self._open
        item.content[0].text += text
        yield self._event(
            "response.reasoning_text.delta", **self._where(item), content_index=0, delta=text
        )

    def _text(self, text: str, logprobs: list[Logprob]) -> Iterator[str]:
        if not isinstance(self._open, OutputMessage):
            yield from self._add(OutputMessage(status="in_progress"), OutputTextPart())
        item = self._open
        item.content[0].text += text
        item.content[0].logprobs += logprobs
        yield self._event(
            "response.output_text.delta",
            **self._where(item),
            content_index=0,
            delta=text,
            logprobs=[_dump(entry) for entry in logprobs],
        )

    def _call(self, call: Any) -> Iterator[str]:
        function = call.function
        if call.index not in self._calls:
            item = FunctionCall(call_id=call.id, name=function.name, status="in_progress")
            self._calls[call.index] = item
            yield from self._add(item, None)
        item = self._calls[call.index]
        if function is not None and function.arguments:
            item.arguments += function.arguments
            yield self._event(
                "response.function_call_arguments.delta",
                **self._where(item),
                delta=function.arguments,
            )

    def _add(self, item: Any, part: BaseModel | None) -> Iterator[str]:
        """Close the open item, then open `item` (with its one content `part`)."""
        yield from self._close()
        self.response.output.append(item)
        self._open = item
        yield self._event(
            "response.output_item.added",
            output_index=len(self.response.output) - 1,
            item=_dump(item),
        )
        if part is not None:
            yield self._event(
                "response.content_part.added",
                **self._where(item),
                content_index=0,
                part=_dump(part),
            )
            item.content.append(part)

    def _close(self) -> Iterator[str]:
        item, self._open = self._open, None
        if item is None:
            return
        item.status = "incomplete" if self.finish_reason == "length" else "completed"
        where = self._where(item)
        if isinstance(item, FunctionCall):
            yield self._event(
                "response.function_call_arguments.done", **where, arguments=item.arguments
            )
        else:
            part = item.content[0]
            if isinstance(item, Reasoning):
                yield self._event(
                    "response.reasoning_text.done", **where, content_index=0, text=part.text
                )
            else:
                logprobs = [_dump(entry) for entry in part.logprobs]
                yield self._event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part.text,
                    logprobs=logprobs,
                )
            yield self._event(
                "response.content_part.done", **where, content_index=0, part=_dump(part)
            )
        yield self._event(
            "response.output_item.done", output_index=where["output_index"], item=_dump(item)
        )

    def _where(self, item: Any) -> dict[str, Any]:
        index = next(i for i, other in enumerate(self.response.output) if other is item)
        return {"item_id": item.id, "output_index": index}

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
