"""What the server sends back: chat completions and text completions, their stream chunks, usage,
logprobs, and the model list.

Every type validates with the official `openai` client's types when dumped with `model_dump()`
(or `model_dump(exclude_none=True)` for compact replies and SSE chunks, which still carry every
field OpenAI's schema requires, null where it has no value: a message's `content`, a choice's
`logprobs` and `finish_reason`). The one exception is the extension
finish reason "abort" (a request cancelled by the server), which the client's lenient parser passes
through but its strict `model_validate` refuses.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

FinishReason = Literal["stop", "length", "tool_calls", "abort"]


def new_completion_id() -> str:
    """A fresh `chatcmpl-...` id."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_text_completion_id() -> str:
    """A fresh `cmpl-...` id (the Completions API's)."""
    return f"cmpl-{uuid.uuid4().hex}"


def new_tool_call_id() -> str:
    """A fresh `call_...` id, 24 hex characters after the prefix as OpenAI's are."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _now() -> int:
    return int(time.time())


class _Required(BaseModel):
    """A model whose `REQUIRED` fields are dumped even when None (`exclude_none` drops the
    rest): OpenAI's schema has them present and null, and clients index them. Its `EXTRAS`
    (AReno's extensions, asked for by a request field) are left out when None in any dump."""

    REQUIRED: ClassVar[tuple[str, ...]] = ()
    EXTRAS: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _with_required(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self.EXTRAS:
            if data.get(name, 0) is None:
                del data[name]
        if all(name in data for name in self.REQUIRED):
            return data
        order = [name for name in type(self).model_fields if name in data or name in self.REQUIRED]
        return {name: data.get(name) for name in order}


class TopLogprob(BaseModel):
    """One alternative token at a position, with its logprob and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """The sampled token at a position, with the most likely alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    """`choices[i].logprobs`: one entry per generated token."""

    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    """The function a tool call invokes; `arguments` is a JSON string, as the model wrote it."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A parsed tool call in a completion's message."""

    id: str = Field(default_factory=new_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(_Required):
    """The assistant message of a non-streaming choice; `content` null when there is none (all
    reasoning, or only tool calls)."""

    REQUIRED = ("content",)

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class Choice(_Required):
    """One of the `n` completions of a request; `token_ids` its sampled ids (with
    `return_token_ids`)."""

    REQUIRED = ("logprobs",)
    EXTRAS = ("token_ids",)

    index: int
    message: ResponseMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None


class PromptTokensDetails(BaseModel):
    """Where the prompt's tokens came from; media counts are after processor expansion."""

    cached_tokens: int | None = None
    text_tokens: int | None = None
    image_tokens: int | None = None
    audio_tokens: int | None = None


class Usage(BaseModel):
    """Token counts of a request; the prompt count is the encoded (media-expanded) length."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def from_counts(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        prompt_tokens_details: PromptTokensDetails | None = None,
    ) -> Usage:
        """Usage with `total_tokens` computed."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=prompt_tokens_details,
        )


class ChatCompletionResponse(_Required):
    """The body of a non-streaming `POST /v1/chat/completions` answer."""

    EXTRAS = ("prompt_token_ids",)

    id: str = Field(default_factory=new_completion_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    # With `return_token_ids`: the prompt as the engine ran it (media placeholders expanded).
    prompt_token_ids: list[int] | None = None


class FunctionCallDelta(BaseModel):
    """A piece of a streamed tool call's function: the name once, then argument fragments."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of the `index`-th tool call of a streamed choice; `id` and `type` come first."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class DeltaMessage(BaseModel):
    """What a stream chunk adds to a choice's message."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(_Required):
    """One choice's part of a stream chunk; `finish_reason` is set on its last chunk (null
    before)."""

    REQUIRED = ("finish_reason",)
    EXTRAS = ("token_ids",)

    index: int
    delta: DeltaMessage = Field(default_factory=DeltaMessage)
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None  # the delta's sampled ids (`return_token_ids`)


class ChatCompletionChunk(_Required):
    """One `data:` event of a streamed answer; the usage-only last chunk has no choices."""

    EXTRAS = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChunkChoice] = Field(default_factory=list)
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # on the first chunk (`return_token_ids`)


class CompletionLogprobs(BaseModel):
    """`choices[i].logprobs` of the Completions API: per token of the choice's text, its string,
    logprob, `{token: logprob}` of the most likely alternatives, and where its text starts in the
    choice's text. An echoed prompt's first token has no logprob and no alternatives (None)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Required):
    """One choice of a text completion, or its part of a stream chunk (`finish_reason` None
    until its last chunk)."""

    REQUIRED = ("logprobs", "finish_reason")
    EXTRAS = ("prompt_token_ids", "token_ids")

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # With `return_token_ids`: its prompt's ids (a stream's first chunk of the choice) and its
    # sampled ids (a stream's: the chunk's).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """The body of a non-streaming `POST /v1/completions` answer, and (with `usage` None, or
    with no choices and the usage) each `data:` event of a streamed one."""

    id: str = Field(default_factory=new_text_completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One entry of `GET /v1/models`."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "areno"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    """The body of `GET /v1/models`."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
