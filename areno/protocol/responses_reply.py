"""The Responses API's reply (`POST /v1/responses`): the response object, its output items
(messages with their text and logprobs, function calls, reasoning) and usage; the request and its
translation are in responses_api.py."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, Field

from areno.protocol.responses_api import ResponsesRequest


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def new_item_id(prefix: str) -> str:
    """A fresh output item id: `msg_...`, `fc_...` or `rs_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


class TopLogprob(BaseModel):
    token: str
    bytes: list[int]
    logprob: float


class Logprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class OutputTextPart(BaseModel):
    """A message's text; `logprobs` empty unless the request included them."""

    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Logprob] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: new_item_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "completed"
    content: list[OutputTextPart] = Field(default_factory=list)


class FunctionCall(BaseModel):
    """A call the client runs; its output goes back as a `function_call_output` item."""

    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: new_item_id("fc"))
    call_id: str
    name: str
    arguments: str = ""
    status: ItemStatus = "completed"


class ReasoningOutputText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class Reasoning(BaseModel):
    """The reply's reasoning block (`reasoning_content` on the chat path)."""

    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: new_item_id("rs"))
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningOutputText] = Field(default_factory=list)
    status: ItemStatus = "completed"


OutputItem = Union[OutputMessage, FunctionCall, Reasoning]  # noqa: UP007


class InputTokensDetails(BaseModel):
    """The prompt tokens the prefix cache held; nothing is written to a cache on request."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponsesUsage(BaseModel):
    """Token counts; input tokens are the encoded (media-expanded) prompt's."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(BaseModel):
    code: Literal["server_error"] = "server_error"
    message: str


class ResponseObject(BaseModel):
    """The body of a non-streaming answer, and the `response` of the lifecycle events."""

    id: str = Field(default_factory=new_response_id)
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponsesUsage | None = None
    # The request's settings, echoed as OpenAI does.
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    truncation: Literal["disabled"] = "disabled"
    previous_response_id: None = None
    store: Literal[False] = False
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def for_request(cls, request: ResponsesRequest, model: str) -> ResponseObject:
        """An empty, in-progress response echoing the request's settings."""
        text = {"format": {"type": "text"}}
        if request.format is not None:
            text = {"format": request.format.model_dump(by_alias=True, exclude_none=True)}
        choice = request.tool_choice
        return cls(
            model=model,
            instructions=request.instructions,
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools or ()],
            tool_choice=choice.model_dump() if isinstance(choice, BaseModel) else choice or "auto",
            parallel_tool_calls=request.parallel_tool_calls is not False,
            text=text,
            max_output_tokens=request.max_output_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_logprobs=request.top_logprobs,
            user=request.user,
            metadata=request.metadata or {},
        )
