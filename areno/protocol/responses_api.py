"""The Responses API (`POST /v1/responses`): its request, translated into the Chat Completions
request that the chat path serves (its reply, output items and usage: responses_reply.py).

A request's `input` is a string (one user message) or a list of items: messages (text, image,
audio and, as AReno extensions, the chat path's media parts such as `video_url`), earlier
`function_call` / `function_call_output` items of a tool loop and earlier `reasoning` items.
`to_chat_request` turns it into a `ChatCompletionRequest`: `instructions` becomes a system
message, a run of reasoning, assistant text and function calls one assistant message with
`tool_calls`, a function call's output a tool message; `tools`, `tool_choice`, `text.format`,
`max_output_tokens`, `include` and the sampling fields map to their chat counterparts. So media
decoding, the processor, the engine, tool-call and reasoning parsing and structured outputs are
the chat path's, and so are its rules: a problem found while building the chat request is
reported at the Responses request's own path.

Every field is honoured or refused with a 400 naming it, as for chat: an unknown field is refused,
and OpenAI fields AReno does not implement (UNSUPPORTED_FIELDS) are refused unless they hold the
value that asks for nothing. The server is stateless: `store: true`, `previous_response_id` and
item references are refused; a client sends the whole conversation as input items.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from areno.protocol.chat import (
    ChatCompletionRequest,
    FunctionDefinition,
    JsonSchemaSpec,
    refuse_unsupported,
)
from areno.protocol.content import (
    AudioPart,
    AudioURLPart,
    ImagePart,
    ImageURLPart,
    InputAudioPart,
    TextPart,
    VideoPart,
    VideoURLPart,
)
from areno.protocol.errors import (
    FieldError,
    RequestValidationError,
    load_request_body,
    validate_request,
)

STATELESS = (
    "AReno is stateless and keeps no responses: send the whole conversation as input items "
    "(earlier output items included)"
)
LOGPROBS_INCLUDE = "message.output_text.logprobs"

# OpenAI request fields AReno does not implement -> (the value that asks for nothing, why).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "store": (False, STATELESS),
    "previous_response_id": (None, STATELESS),
    "conversation": (None, STATELESS),
    "background": (False, "AReno answers in the foreground only"),
    "background_options": (None, "AReno answers in the foreground only"),
    "prompt": (None, "AReno has no stored prompt templates: send instructions and input"),
    "reasoning": (
        None,
        'use chat_template_kwargs (e.g. {"enable_thinking": false}) to steer reasoning',
    ),
    "truncation": ("disabled", "AReno refuses a prompt over its limits rather than cut it"),
    "max_tool_calls": (None, "not supported: the client runs the tools and decides"),
    "service_tier": ("auto", "AReno has one tier"),
    "prompt_cache_key": (None, "AReno's prefix cache needs no key"),
    "prompt_cache_retention": (None, "AReno's prefix cache needs no settings"),
    "prompt_cache_options": (None, "AReno's prefix cache needs no settings"),
    "safety_identifier": (None, "not supported: use 'user'"),
    "context_management": (None, "not supported"),
    "moderation": (None, "AReno does not moderate"),
    "image": (None, "AReno answers with text only"),
    "access_programs": (None, "not supported"),
}

# Chat Completions extensions a Responses request may carry too (vLLM's names; the openai
# client sends them through `extra_body`); the chat request checks them.
CHAT_EXTENSIONS = (
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "seed",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "chat_template_kwargs",
)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Echoed(BaseModel):
    """An item a client may send back from an earlier reply: fields of the reply it does not
    need (ids, status, annotations) are ignored, as chat ignores them on messages."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# --- input content parts ---------------------------------------------------------------------


class InputText(_Wire):
    """`{"type": "input_text", "text": ...}`."""

    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = Field(default=None, exclude=True)


class OutputText(_Echoed):
    """An earlier reply's text, sent back in an assistant message."""

    type: Literal["output_text"]
    text: str


class Refusal(_Echoed):
    """An earlier reply's refusal, sent back in an assistant message (read as its text)."""

    type: Literal["refusal"]
    refusal: str


class InputImage(_Wire):
    """`{"type": "input_image", "image_url": ..., "detail": ...}`: a local path, `file://`,
    `data:` or `http(s)://` URL, as the chat path's `image_url` parts take."""

    type: Literal["input_image"]
    image_url: str | None = Field(default=None, min_length=1)
    file_id: str | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = Field(default=None, exclude=True)

    @field_validator("file_id")
    @classmethod
    def _no_files(cls, file_id: str | None) -> None:
        if file_id is not None:
            raise ValueError("AReno has no Files API: send the image in 'image_url'")

    @model_validator(mode="after")
    def _needs_url(self) -> InputImage:
        if self.image_url is None:
            raise ValueError("an input_image needs 'image_url' (a path or URL)")
        return self


class InputFile(_Wire):
    """`input_file`: refused (AReno reads images, audio and video, not documents)."""

    type: Literal["input_file"]

    model_config = ConfigDict(extra="allow")

    @field_validator("type")
    @classmethod
    def _refused(cls, kind: str) -> str:
        raise ValueError(
            "input_file is not supported: send input_image or input_audio parts, or the "
            "chat path's video_url / audio_url parts"
        )


_PART_CLASSES: dict[str, type[BaseModel]] = {
    "input_text": InputText,
    "input_image": InputImage,
    "input_audio": InputAudioPart,
    "input_file": InputFile,
    "output_text": OutputText,
    "refusal": Refusal,
    # The chat path's parts, as AReno extensions (video has no Responses part of its own).
    "text": TextPart,
    "image_url": ImageURLPart,
    "audio_url": AudioURLPart,
    "video_url": VideoURLPart,
    "image": ImagePart,
    "audio": AudioPart,
    "video": VideoPart,
}


def _tagged(classes: dict[str, type[BaseModel]], what: str, default: str | None = None) -> Any:
    """A union of `classes` discriminated by their `type`; an unknown or missing type is one
    error listing the accepted ones."""

    def tag_of(value: Any) -> str | None:
        kind = (
            value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        )
        return kind if kind in classes else None

    accepted = ", ".join(map(repr, classes))
    union = Union[tuple(Annotated[cls, Tag(tag)] for tag, cls in classes.items())]  # noqa: UP007
    return Annotated[
        union,
        Discriminator(
            tag_of,
            custom_error_type="item_type",
            custom_error_message=f"unknown or missing {what} type; expected one of: {accepted}",
        ),
    ]


InputPart = _tagged(_PART_CLASSES, "content part")


def _str_or_list(item: Any, what: str = "content parts") -> Any:
    return Annotated[
        Union[Annotated[str, Tag("str")], Annotated[list[item], Tag("list")]],  # noqa: UP007
        Discriminator(
            lambda v: "str" if isinstance(v, str) else "list" if isinstance(v, list) else None,
            custom_error_type="content_type",
            custom_error_message=f"Input should be a string or an array of {what}",
        ),
    ]


# --- input items -----------------------------------------------------------------------------


class MessageItem(_Echoed):
    """A message: `{"role": ..., "content": ...}` with or without `"type": "message"`."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: _str_or_list(InputPart)


class FunctionCallItem(_Echoed):
    """An earlier reply's call of a function, sent back before its output."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(_Echoed):
    """What the client's function returned for the call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: _str_or_list(InputPart)


class ReasoningText(_Echoed):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Echoed):
    """An earlier reply's reasoning, sent back: the template sees its text (content, else its
    summary) as that turn's reasoning."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _none_encrypted(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("AReno never encrypts reasoning: send its text in 'content'")

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


class ItemReference(_Echoed):
    """`item_reference`: refused, the server keeps no items."""

    type: Literal["item_reference"]

    @field_validator("type")
    @classmethod
    def _refused(cls, kind: str) -> str:
        raise ValueError(f"is not supported: {STATELESS}")


_ITEM_CLASSES: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
    "item_reference": ItemReference,
}
InputItem = _tagged(_ITEM_CLASSES, "input item", default="message")


# --- tools, tool choice, text format ---------------------------------------------------------


class FunctionTool(FunctionDefinition):
    """`{"type": "function", "name": ..., "parameters": ..., "strict": ...}`: the client runs it."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]


def _function_tool(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type", "function") != "function":
        raise ValueError(
            f"tool type {value['type']!r} is not supported: AReno runs no hosted tools; "
            "declare a 'function' tool and run it in the client"
        )
    return value


class FunctionToolChoice(_Wire):
    """`{"type": "function", "name": ...}`: the model must call this function."""

    type: Literal["function"]
    name: str


ToolChoice = Annotated[
    Union[  # noqa: UP007
        Annotated[Literal["none", "auto", "required"], Tag("mode")],
        Annotated[FunctionToolChoice, Tag("named")],
    ],
    Discriminator(
        lambda v: "mode" if isinstance(v, str) else "named" if isinstance(v, dict) else None,
        custom_error_type="wire_type",
        custom_error_message="Input should be 'none', 'auto', 'required' or "
        '{"type": "function", "name": ...}',
    ),
]


class TextFormatPlain(_Wire):
    type: Literal["text"]


class TextFormatJsonObject(_Wire):
    type: Literal["json_object"]


class TextFormatJsonSchema(JsonSchemaSpec):
    """`{"type": "json_schema", "name": ..., "schema": ..., "strict": ...}`."""

    type: Literal["json_schema"]


TextFormat = _tagged(
    {
        "text": TextFormatPlain,
        "json_object": TextFormatJsonObject,
        "json_schema": TextFormatJsonSchema,
    },
    "text format",
)


class TextConfig(_Wire):
    """`text`: the reply's format (free text, any JSON object, or JSON following a schema)."""

    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class StreamOptions(_Wire):
    include_obfuscation: Literal[False] | None = None


# --- the request -----------------------------------------------------------------------------


class ResponsesRequest(BaseModel):
    """`POST /v1/responses` body. `model` is optional: the server answers with the model it
    serves. Beyond OpenAI's fields it takes the chat path's sampling extensions
    (CHAT_EXTENSIONS)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    input: _str_or_list(InputItem, "input items")
    instructions: str | None = None
    tools: list[Annotated[FunctionTool, BeforeValidator(_function_tool)]] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None

    # Chat Completions extensions, checked by the chat request (to_chat_request).
    top_k: Any = None
    min_p: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    seed: Any = None
    min_tokens: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    chat_template_kwargs: Any = None

    # OpenAI fields AReno does not implement: refused unless neutral (UNSUPPORTED_FIELDS).
    store: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    background_options: Any = None
    prompt: Any = None
    reasoning: Any = None
    truncation: Any = None
    max_tool_calls: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    safety_identifier: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None

    @field_validator(*UNSUPPORTED_FIELDS, mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        refuse_unsupported(UNSUPPORTED_FIELDS, info.field_name, value)

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must hold at least one item")
        return value

    @field_validator("include")
    @classmethod
    def _includable(cls, include: list[str] | None) -> list[str] | None:
        other = [name for name in include or () if name != LOGPROBS_INCLUDE]
        if other:
            raise ValueError(
                f"{', '.join(map(repr, other))} cannot be included: AReno includes only "
                f"{LOGPROBS_INCLUDE!r}"
            )
        return include

    @field_validator("stream", mode="before")
    @classmethod
    def _null_is_false(cls, value: Any) -> Any:
        return False if value is None else value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, options: Any, info: ValidationInfo) -> Any:
        if options is not None and not info.data.get("stream", True):
            raise ValueError("only allowed with 'stream': true")
        return options

    @property
    def logprobs(self) -> bool:
        """Whether the reply's text carries its tokens' logprobs."""
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)

    @property
    def format(self) -> Any:
        return self.text.format if self.text is not None else None


def parse_responses_request(data: bytes | bytearray | str | dict[str, Any]) -> ResponsesRequest:
    """Parse an untrusted body; every problem with it raises `RequestValidationError`."""
    return validate_request(load_request_body(data), ResponsesRequest)


# --- the translation -------------------------------------------------------------------------


def _chat_part(part: BaseModel) -> dict[str, Any]:
    """A Responses content part as the chat path's part (a JSON object)."""
    if isinstance(part, (InputText, OutputText)):
        return {"type": "text", "text": part.text}
    if isinstance(part, Refusal):
        return {"type": "text", "text": part.refusal}
    if isinstance(part, InputImage):
        image = {"url": part.image_url} | ({"detail": part.detail} if part.detail else {})
        return {"type": "image_url", "image_url": image}
    return part.model_dump(exclude_none=True)


def _chat_content(content: str | list[BaseModel]) -> str | list[dict[str, Any]]:
    return content if isinstance(content, str) else [_chat_part(p) for p in content]


def _text_of(content: str | list[BaseModel]) -> str:
    if isinstance(content, str):
        return content
    return "".join(_chat_part(p).get("text", "") for p in content)


class _Conversation:
    """Chat messages built from input items, each with the path of the item it came from."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.origins: list[tuple[str, str]] = []  # (item path, its content key)
        self._open = False  # the last message is an assistant turn items may still extend

    def add(self, message: dict[str, Any], path: str, content_key: str = "content") -> None:
        self.messages.append(message)
        self.origins.append((path, content_key))
        self._open = message["role"] == "assistant"

    def assistant(self, path: str, *, after: tuple[str, ...]) -> dict[str, Any]:
        """The open assistant turn, unless it already holds one of `after`; else a new one."""
        last = self.messages[-1] if self._open else None
        if last is None or any(last.get(key) for key in after):
            self.add({"role": "assistant", "content": None}, path)
            last = self.messages[-1]
        return last


def _messages(request: ResponsesRequest) -> _Conversation:
    conversation = _Conversation()
    if request.instructions is not None:
        conversation.add({"role": "system", "content": request.instructions}, "instructions")
    if isinstance(request.input, str):
        conversation.add({"role": "user", "content": request.input}, "input")
        return conversation
    for i, item in enumerate(request.input):
        path = f"input[{i}]"
        if isinstance(item, ReasoningItem):
            turn = conversation.assistant(
                path, after=("reasoning_content", "content", "tool_calls")
            )
            turn["reasoning_content"] = item.text
        elif isinstance(item, FunctionCallItem):
            turn = conversation.assistant(path, after=())
            call = {"name": item.name, "arguments": item.arguments}
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": call}
            )
        elif isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "tool_call_id": item.call_id}
            conversation.add(message | {"content": _chat_content(item.output)}, path, "output")
        elif item.role == "assistant":
            turn = conversation.assistant(path, after=("content", "tool_calls"))
            turn["content"] = _text_of(item.content)
        else:
            conversation.add({"role": item.role, "content": _chat_content(item.content)}, path)
    return conversation


def _chat_fields(request: ResponsesRequest) -> dict[str, Any]:
    """Every field of the chat request but `messages`."""
    body: dict[str, Any] = {"model": request.model, "stream": request.stream}
    if request.tools is not None:
        body["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in request.tools
        ]
    choice = request.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    body["tool_choice"] = choice
    body["parallel_tool_calls"] = request.parallel_tool_calls
    body["response_format"] = _response_format(request.format)
    body["max_completion_tokens"] = request.max_output_tokens
    body["temperature"], body["top_p"] = request.temperature, request.top_p
    body["logprobs"], body["top_logprobs"] = request.logprobs, request.top_logprobs
    body["user"], body["metadata"] = request.user, request.metadata
    body |= {name: getattr(request, name) for name in CHAT_EXTENSIONS}
    return {key: value for key, value in body.items() if value is not None}


def _response_format(text_format: Any) -> dict[str, Any] | None:
    if text_format is None:
        return None
    if isinstance(text_format, TextFormatJsonSchema):
        spec = text_format.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
        return {"type": "json_schema", "json_schema": spec}
    return {"type": text_format.type}


# Chat request paths -> the Responses request's paths (besides messages[i]).
_PATH_REWRITES = (
    (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
    (re.compile(r"^response_format\.json_schema"), "text.format"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^logprobs"), "include"),
    (re.compile(r"^messages(?=$|\.)"), "input"),
)
_MESSAGE_PATH = re.compile(r"^messages\[(\d+)\](\.content)?")


def _responses_path(path: str, origins: list[tuple[str, str]]) -> str:
    if match := _MESSAGE_PATH.match(path):
        origin, content_key = origins[int(match.group(1))]
        suffix = f".{content_key}" if match.group(2) else ""
        return origin + suffix + path[match.end() :]
    for pattern, replacement in _PATH_REWRITES:
        path = pattern.sub(replacement, path, count=1)
    return path


def responses_error(error: RequestValidationError, origins: list[tuple[str, str]]):
    """`error`, raised by a chat request built from a Responses request, at that request's
    paths (messages[i] -> the input item it came from, tools[i].function -> tools[i]...)."""
    errors = [FieldError(_responses_path(e.path, origins), e.message) for e in error.errors]
    return type(error)(errors)


def to_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The Chat Completions request the chat path serves for `request`; a rule of the chat
    request it breaks raises `RequestValidationError` at the Responses request's path."""
    conversation = _messages(request)
    body = {"messages": conversation.messages} | _chat_fields(request)
    try:
        return validate_request(body, ChatCompletionRequest)
    except RequestValidationError as error:
        raise responses_error(error, conversation.origins) from None
