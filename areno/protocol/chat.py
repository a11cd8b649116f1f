"""The Chat Completions request: messages, tools, sampling fields and structured outputs.

Every field a request may carry is declared here and either does what OpenAI (or vLLM, for its
extensions) says it does, or is refused with a 400 naming it: an unknown field is refused, and
OpenAI fields AReno does not implement (UNSUPPORTED_FIELDS) are refused unless they hold the
value that asks for nothing. Cross-field rules are field validators that read earlier fields,
so each error carries the path of the field the user must change; the NOTE below marks the
field order they rely on.
"""

from __future__ import annotations

from collections.abc import Iterator
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

from areno.protocol.content import ChatMessage, MediaPart, iter_media_parts

# NOTE: limits are read at validation time, so a deployment (or a test) may change them.
MAX_MESSAGES = 4096
MAX_PARTS_PER_REQUEST = 2048
MAX_TOOLS = 256
MAX_STOP_SEQUENCES = 16
MAX_STOP_TOKEN_IDS = 256
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 300

# OpenAI request fields AReno does not implement -> (the value that asks for nothing, why).
# Any other value is refused with a 400 naming the field; the value itself is accepted.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "store": (False, "AReno does not store completions"),
    "audio": (None, "AReno answers with text only"),
    "modalities": (["text"], "AReno answers with text only"),
    "prediction": (None, "predicted outputs are not supported"),
    "reasoning_effort": (
        None,
        'use chat_template_kwargs (e.g. {"enable_thinking": false}) to steer reasoning',
    ),
    "verbosity": (None, "not supported"),
    "web_search_options": (None, "AReno has no web search"),
    "service_tier": ("auto", "AReno has one tier"),
    "functions": (None, "deprecated by OpenAI: send 'tools'"),
    "function_call": (None, "deprecated by OpenAI: send 'tool_choice'"),
    "best_of": (None, "not supported: use 'n'"),
    "prompt_cache_key": (None, "AReno's prefix cache needs no key"),
    "safety_identifier": (None, "not supported: use 'user'"),
}


def refuse_unsupported(table: dict[str, tuple[Any, str]], field: str, value: Any) -> None:
    """None where `value` asks for nothing of `table`'s unimplemented `field`, else a
    ValueError saying why it is not supported (pydantic names the field in the 400)."""
    neutral, why = table[field]
    if value is not None and value != neutral:
        raise ValueError(f"{value!r} is not supported: {why}")


_TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"

# Names the server's own chat-template call already passes (to transformers' apply_chat_template
# or to the template itself). From chat_template_kwargs they would crash that call, change what
# it returns, or, for chat_template, run the client's own Jinja on the server.
RESERVED_TEMPLATE_KWARGS = frozenset(
    [
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "conversation",
        "conversations",
        "documents",
        "load_audio_from_video",
        "max_length",
        "messages",
        "padding",
        "processor_kwargs",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "sanitize_control_tokens",
        "tokenize",
        "tokenizer_kwargs",
        "tools",
        "truncation",
    ]
)
_SCHEMA_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


# JSON Schema keywords the grammar engine (xgrammar) would not enforce: a schema using one is
# refused rather than followed loosely. `multipleOf` is enforced on integer schemas only,
# `format` for the formats in GRAMMAR_FORMATS, `allOf` with one subschema, `uniqueItems` false.
# NOTE: measured on xgrammar's compiler (a string the keyword forbids, accepted):
# `uniqueItems` and `dependentRequired` are dropped; `patternProperties` makes it refuse the
# objects the pattern allows; `allOf` of two or more schemas and `multipleOf` on a number are
# dropped with a warning.
UNENFORCED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentSchemas",
    "dependentRequired",
    "dependencies",
    "patternProperties",
    "unevaluatedItems",
    "$dynamicRef",
    "$recursiveRef",
)
GRAMMAR_FORMATS = (
    "date",
    "date-time",
    "duration",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "json-pointer",
    "relative-json-pointer",
    "time",
    "uri",
    "uri-reference",
    "uri-template",
    "uuid",
)


def _subschemas(node: dict, where: str) -> Iterator[tuple[Any, str]]:
    """Each schema nested in `node`, with its path."""
    for key in _SUBSCHEMA_MAPS:
        children = node.get(key)
        if isinstance(children, dict):
            yield from ((child, f"{where}.{key}.{name}") for name, child in children.items())
    for key in _SUBSCHEMA_LISTS:
        children = node.get(key)
        if isinstance(children, list):
            yield from ((child, f"{where}.{key}[{i}]") for i, child in enumerate(children))
    for key in _SUBSCHEMA:
        if key in node:
            children = node[key] if isinstance(node[key], list) else [node[key]]
            yield from ((child, f"{where}.{key}") for child in children)


def unenforced_schema_features(schema: Any, where: str, also: tuple[str, ...] = ()) -> list[str]:
    """The places in a (shape-checked) JSON Schema that a grammar cannot enforce, as
    "PATH.KEYWORD" strings; [] when it can enforce all of it. `also`: keywords a particular
    call syntax's grammar cannot enforce either."""
    found: list[str] = []
    stack: list[tuple[Any, str]] = [(schema, where)]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        found += [f"{path}.{key}" for key in (*UNENFORCED_KEYWORDS, *also) if key in node]
        if node.get("uniqueItems", False) is not False:
            found.append(f"{path}.uniqueItems")
        if len(node.get("allOf") or []) > 1:
            found.append(f"{path}.allOf (of more than one schema)")
        multiple = node.get("multipleOf")
        if multiple is not None and not (
            isinstance(multiple, int) and multiple > 0 and node.get("type") == "integer"
        ):
            found.append(f"{path}.multipleOf (only positive integers, on an integer schema)")
        if "format" in node and node["format"] not in GRAMMAR_FORMATS:
            found.append(f"{path}.format {node['format']!r}")
        stack.extend(_subschemas(node, path))
    return sorted(found)


def check_enforceable(schema: Any, where: str, also: tuple[str, ...] = ()) -> Any:
    """`schema`, or a ValueError naming what a grammar could not enforce in it."""
    unenforced = unenforced_schema_features(schema, where, also)
    if unenforced:
        formats = f" (supported formats: {', '.join(GRAMMAR_FORMATS)})"
        raise ValueError(
            "uses JSON Schema features structured outputs cannot enforce: "
            + ", ".join(unenforced)
            + (formats if any(".format " in item for item in unenforced) else "")
        )
    return schema


def schema_problem(schema: Any) -> str | None:
    """The first keyword of a JSON Schema holding the wrong kind of value, or None.

    Not a full validator: it checks the shapes chat templates walk (`properties` is an object of
    schemas, `required` a list of names, `type` a JSON type...), so a schema that is not one is
    refused here instead of failing inside a template.
    """
    stack: list[tuple[Any, str]] = [(schema, "parameters")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, bool):  # true / false are schemas too
            continue
        if not isinstance(node, dict):
            return f"{where} must be a JSON Schema (an object)"
        types = node.get("type", [])
        for kind in types if isinstance(types, list) else [types]:
            if kind not in _SCHEMA_TYPES:
                return f"{where}.type {kind!r} is not one of {', '.join(_SCHEMA_TYPES)}"
        required = node.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            return f"{where}.required must be a list of property names"
        if not isinstance(node.get("enum", []), list):
            return f"{where}.enum must be a list"
        for key in _SUBSCHEMA_MAPS:
            children = node.get(key, {})
            if not isinstance(children, dict):
                return f"{where}.{key} must be an object mapping names to schemas"
            stack.extend((child, f"{where}.{key}.{name}") for name, child in children.items())
        for key in _SUBSCHEMA_LISTS:
            children = node.get(key, [])
            if not isinstance(children, list):
                return f"{where}.{key} must be a list of schemas"
            stack.extend((child, f"{where}.{key}[{i}]") for i, child in enumerate(children))
        for key in _SUBSCHEMA:
            if key in node:  # `items` may also be a list of schemas (draft 4's tuple form)
                children = node[key] if isinstance(node[key], list) else [node[key]]
                stack.extend((child, f"{where}.{key}") for child in children)
    return None


class FunctionDefinition(BaseModel):
    """A function the model may call; `parameters` is a JSON Schema of type "object"."""

    name: str = Field(pattern=_TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None and schema.get("type") != "object":
            raise ValueError(
                'must be a JSON Schema with "type": "object" (use {"type": "object", '
                f'"properties": {{}}}} for no arguments); got type {schema.get("type")!r}'
            )
        if schema is not None and (problem := schema_problem(schema)):
            raise ValueError(f"is not a valid JSON Schema: {problem}")
        return schema

    @field_validator("strict")
    @classmethod
    def _strict_schema_is_enforceable(cls, strict: bool | None, info: ValidationInfo) -> Any:
        if strict and info.data.get("parameters") is not None:
            check_enforceable(info.data["parameters"], "parameters")
        return strict


class ToolDefinition(BaseModel):
    """`{"type": "function", "function": {...}}`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    """The `function` object of a named tool choice."""

    name: str


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: the model must call this tool."""

    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class JsonSchemaSpec(BaseModel):
    """`response_format.json_schema`: the schema the reply must follow."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _enforceable(cls, schema: dict[str, Any] | bool) -> Any:
        if isinstance(schema, dict) and (problem := schema_problem(schema)):
            raise ValueError(
                f"is not a valid JSON Schema: {problem.replace('parameters', 'schema', 1)}"
            )
        return check_enforceable(schema, "schema")


class ResponseFormat(BaseModel):
    """`response_format`: free text (`text`), any JSON object (`json_object`), or JSON that
    follows a schema (`json_schema`); enforced by a grammar, not asked for in the prompt."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @field_validator("json_schema")
    @classmethod
    def _only_for_json_schema(cls, spec: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("type")
        if spec is not None and kind != "json_schema":
            raise ValueError(f"only allowed with type 'json_schema' (type is {kind!r})")
        return spec

    @model_validator(mode="after")
    def _json_schema_needs_spec(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object with the schema")
        return self


def _logit_bias(value: Any) -> Any:
    """OpenAI's `{"token id": bias}` as {int: float}, refusing keys that are not token ids."""
    if not isinstance(value, dict):
        return value
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"{len(value)} entries exceed the limit of {MAX_LOGIT_BIAS_ENTRIES}")
    parsed = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()) and not (
            isinstance(key, int) and not isinstance(key, bool) and key >= 0
        ):
            raise ValueError(f"keys must be token ids (strings of digits); got {key!r}")
        parsed[int(key)] = bias
    return parsed


LogitBias = Annotated[
    dict[int, Annotated[float, Field(ge=-100, le=100)]], BeforeValidator(_logit_bias)
]


class StreamOptions(BaseModel):
    """`stream_options`; only valid with `stream: true`."""

    include_usage: bool | None = None


def _tagged_by_python_type(tags: dict[type, str], message: str) -> Discriminator:
    def tag_of(value: Any) -> str | None:
        return next((tag for kind, tag in tags.items() if isinstance(value, kind)), None)

    return Discriminator(tag_of, custom_error_type="wire_type", custom_error_message=message)


ToolChoice = Annotated[
    Union[  # noqa: UP007 -- tagged unions need the runtime Union
        Annotated[Literal["none", "auto", "required"], Tag("mode")],
        Annotated[NamedToolChoice, Tag("named")],
    ],
    _tagged_by_python_type(
        {str: "mode", dict: "named", NamedToolChoice: "named"},
        "Input should be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
    ),
]


def _check_length(limit_name: str, what: str) -> BeforeValidator:
    def check(value: Any) -> Any:
        limit = globals()[limit_name]
        if isinstance(value, list) and len(value) > limit:
            raise ValueError(f"{len(value)} {what} exceed the limit of {limit}")
        return value

    return BeforeValidator(check)


_StopSequence = Annotated[str, Field(min_length=1)]
Stop = Annotated[
    Union[  # noqa: UP007
        Annotated[_StopSequence, Tag("str")],
        Annotated[
            list[_StopSequence], _check_length("MAX_STOP_SEQUENCES", "stop sequences"), Tag("list")
        ],
    ],
    _tagged_by_python_type(
        {str: "str", list: "list"}, "Input should be a string or an array of strings"
    ),
]

StopTokenIds = Annotated[
    list[Annotated[int, Field(ge=0)]], _check_length("MAX_STOP_TOKEN_IDS", "stop token ids")
]


def _count_parts(messages: Any) -> Any:
    """Refuse oversized bodies before validating their parts one by one."""
    if not isinstance(messages, list):
        return messages
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"{len(messages)} messages exceed the limit of {MAX_MESSAGES}")
    contents = (m.get("content") for m in messages if isinstance(m, dict))
    num_parts = sum(len(c) for c in contents if isinstance(c, list))
    if num_parts > MAX_PARTS_PER_REQUEST:
        raise ValueError(
            f"{num_parts} content parts exceed the limit of {MAX_PARTS_PER_REQUEST} per request"
        )
    return messages


class GenerationRequest(BaseModel):
    """What the Chat Completions and Completions requests share: the rules and readings of
    their common sampling and streaming fields (`top_k`, `min_tokens`, `stop`, `stream`,
    `stream_options`), which each subclass declares in its own order."""

    @field_validator("top_k", check_fields=False)
    @classmethod
    def _top_k_range(cls, top_k: int | None) -> int | None:
        if top_k is not None and top_k != -1 and top_k < 1:
            raise ValueError("must be -1 (disabled) or at least 1")
        return top_k

    @field_validator("min_tokens", check_fields=False)
    @classmethod
    def _min_tokens_within_max(cls, min_tokens: int | None, info: ValidationInfo) -> Any:
        limit = info.data.get("max_completion_tokens") or info.data.get("max_tokens")
        if min_tokens is not None and limit is not None and min_tokens > limit:
            raise ValueError(f"= {min_tokens} is above the token limit {limit}")
        return min_tokens

    @field_validator("stream_options", check_fields=False)
    @classmethod
    def _stream_options_need_stream(cls, options: Any, info: ValidationInfo) -> Any:
        if options is not None and not info.data.get("stream", True):
            raise ValueError("only allowed with 'stream': true")
        return options

    @property
    def stop_sequences(self) -> list[str]:
        """`stop` as a list (empty when not given)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationRequest):
    """`POST /v1/chat/completions` body.

    Extensions beyond OpenAI (as vLLM names them): `top_k`, `min_p`, `repetition_penalty`,
    `stop_token_ids`, `ignore_eos`, `chat_template_kwargs` (e.g. `{"enable_thinking": false}`),
    `return_token_ids` (the prompt's ids as the engine ran them, media expanded, and each
    choice's sampled ids: a trainer never re-tokenizes the text).
    `model` is optional: the server answers with the model it serves.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # NOTE: validators below read earlier fields; keep tools before tool_choice, logprobs before
    # top_logprobs, stream before stream_options and max_tokens before min_tokens.
    model: str | None = None
    messages: Annotated[list[ChatMessage], BeforeValidator(_count_parts)] = Field(min_length=1)
    tools: Annotated[list[ToolDefinition], _check_length("MAX_TOOLS", "tools")] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: LogitBias | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    n: int = Field(default=1, ge=1, le=MAX_N)

    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int | None = Field(default=None, ge=0)
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False

    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False

    user: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None

    # OpenAI fields AReno does not implement: refused unless neutral (UNSUPPORTED_FIELDS).
    store: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    functions: Any = None
    function_call: Any = None
    best_of: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None

    @field_validator(*UNSUPPORTED_FIELDS, mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        refuse_unsupported(UNSUPPORTED_FIELDS, info.field_name, value)

    @field_validator("n", "logprobs", "stream", "ignore_eos", "return_token_ids", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        # Client wrappers often send `null` for "not set".
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        names = [tool.function.name for tool in tools or ()]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"tool names must be unique; repeated: {', '.join(duplicates)}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        if choice is None or "tools" not in info.data:  # no choice, or tools already invalid
            return choice
        names = [tool.function.name for tool in info.data["tools"] or ()]
        if choice == "required" and not names:
            raise ValueError("'required' needs a non-empty 'tools' list")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            available = ", ".join(names) if names else "the request has no tools"
            raise ValueError(
                f"names tool {choice.function.name!r}, which is not in 'tools' ({available})"
            )
        return choice

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_template_kwargs(cls, kwargs: dict[str, Any] | None) -> Any:
        reserved = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(
                f"{', '.join(map(repr, reserved))} cannot be set here: the server's chat-template "
                "call sets it; pass only the template's own variables (e.g. enable_thinking)"
            )
        return kwargs

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> Any:
        if top_logprobs and not info.data.get("logprobs", True):
            raise ValueError("requires 'logprobs': true")
        return top_logprobs

    @property
    def max_new_tokens(self) -> int | None:
        """The generation limit: `max_completion_tokens` if given, else `max_tokens`."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def media_parts(self) -> Iterator[tuple[int, MediaPart]]:
        """`(message_index, part)` for every media part of the request, in order."""
        return iter_media_parts(self.messages)
