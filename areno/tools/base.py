"""The tool-parser interface: model text in, OpenAI `message.tool_calls` out, whole or streamed.

Every supported format wraps each call in a start and an end tag (`<tool_call>...</tool_call>`,
`<|tool_call>...<tool_call|>`) and differs only in the body between them. So a format is a
`ToolParser` subclass that names its tags and parses one body; the scanning, the hold-back of
text that may be a tag, the malformed-call fallback and the OpenAI delta shape live here once.
`parse` runs the same scanner as streaming over the whole text, so both always agree.

Content rules (what `ParsedToolCalls.content` holds):
- Text outside tool-call blocks passes through unchanged, except that whitespace between a call
  and the start or end of the content is dropped ("I'll check.\\n\\n<tool_call>..." gives
  "I'll check."; a reply of calls only gives "").
- A block that is not a well-formed call (unclosed at the end, a body that does not parse, a start
  tag in prose) is content, verbatim, and counts in `num_malformed`; parsing never raises.
"""

from __future__ import annotations

import json
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from areno.protocol.chat import ToolDefinition
from areno.protocol.responses import (
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    new_tool_call_id,
)

# A tool as the request gives it: a validated ToolDefinition or its plain-dict form.
Tool = ToolDefinition | Mapping[str, Any]
# Function name -> its JSON Schema `parameters` ({} when the tool has none).
ToolSchemas = dict[str, dict[str, Any]]

NOT_JSON = object()  # what try_json returns for text that is not JSON (JSON null is None)


@dataclass(frozen=True)
class ContentDelta:
    """A piece of the message's `content` in a stream."""

    text: str


StreamEvent = ContentDelta | ToolCallDelta


@dataclass(frozen=True)
class ParsedCall:
    """One well-formed call, before it gets an id: the function name and decoded arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedToolCalls:
    """What a complete generation holds: content ("" when none), calls, and malformed blocks."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    num_malformed: int = 0

    @classmethod
    def from_events(cls, events: Sequence[StreamEvent], num_malformed: int = 0) -> ParsedToolCalls:
        """Accumulate stream events the way an OpenAI client does."""
        content: list[str] = []
        calls: dict[int, tuple[str, str, list[str]]] = {}  # index -> (id, name, argument pieces)
        for event in events:
            if isinstance(event, ContentDelta):
                content.append(event.text)
                continue
            fn = event.function or FunctionCallDelta()
            if event.index not in calls:
                calls[event.index] = (event.id or new_tool_call_id(), fn.name or "", [])
            calls[event.index][2].append(fn.arguments or "")
        tool_calls = [
            ToolCall(id=call_id, function=FunctionCall(name=name, arguments="".join(pieces)))
            for call_id, name, pieces in (calls[i] for i in sorted(calls))
        ]
        return cls("".join(content), tool_calls, num_malformed)


def try_json(text: str) -> Any:
    """`text` decoded as JSON, or NOT_JSON. Raw control characters in strings are tolerated
    (models write literal newlines); NaN and Infinity are not, since they cannot be re-encoded
    as valid JSON arguments."""
    try:
        value = json.loads(text, strict=False, parse_constant=_reject_constant)
        # An overflowing literal such as 1e999 decodes to inf without calling parse_constant.
        return value if _is_finite(value) else NOT_JSON
    except (ValueError, RecursionError):
        return NOT_JSON


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def dump_arguments(arguments: dict[str, Any]) -> str:
    """The OpenAI `arguments` string: JSON text, non-ASCII kept as is."""
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)


def _is_finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_is_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_is_finite(v) for v in value)
    return True


def tool_schemas(tools: Sequence[Tool] | None) -> ToolSchemas:
    """Map each tool's function name to its parameter schema."""
    schemas: ToolSchemas = {}
    for tool in tools or ():
        if isinstance(tool, ToolDefinition):
            schemas[tool.function.name] = tool.function.parameters or {}
            continue
        fn = tool.get("function", tool)
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            schemas[fn["name"]] = dict(fn.get("parameters") or {})
    return schemas


def is_valid_name(name: Any) -> bool:
    """A function name a client can route: a non-empty string without whitespace or tag marks."""
    return isinstance(name, str) and bool(name) and not any(c.isspace() or c in "<>" for c in name)


class ToolParser(ABC):
    """One tool-call format: its tags and how to read the body between them."""

    start_tag: str
    end_tag: str
    # How every well-formed body begins (after leading whitespace). A start tag followed by
    # anything else is prose, released as content at once instead of held to the end.
    body_opening: str

    @abstractmethod
    def parse_call(self, body: str, schemas: ToolSchemas) -> ParsedCall | None:
        """The call in `body` (the text between the tags), or None when it is malformed."""

    # How a call writes its arguments, as an xgrammar JSON-schema style ("json", "qwen_xml",
    # "gemma"): what a grammar constraining them to the tool's schema produces.
    argument_style: str = "json"
    # What follows the arguments up to and including the end tag.
    call_closing: str

    @abstractmethod
    def call_opening(self, name: str) -> str:
        """A call of `name` as the template writes it, from its start tag up to its arguments
        (the grammar of a constrained call is `call_opening(name) ARGS call_closing`).

        NOTE: `forced_prefix(None)` and `forced_prefix(name)` are prefixes of it."""

    @abstractmethod
    def forced_prefix(self, name: str | None) -> str:
        """The opening of a call as the family's template writes it, for forcing a call without
        a grammar: the server appends it to the generation prompt and parses it in front of the
        generated text. `name` None (tool_choice "required") opens a call to any function; a
        name (a named tool_choice) also writes that function's name.

        NOTE: it ends where the template's text continues at a token boundary (never with a
        trailing space the model would write as part of its next token), and
        `parse(forced_prefix(name) + rest)` reads the call when `rest` completes it as the
        template does.
        """

    @abstractmethod
    def argument_layout(self, name: str, key: str) -> tuple[str, str]:
        """A call of `name` with one argument `key` as the template writes it: its text before
        the written value (from the start tag) and after it (up to and including the end tag)."""

    def write_value(self, value: Any) -> str:
        """An argument's value as the family writes it in a call (JSON by default)."""
        return json.dumps(value, ensure_ascii=False)

    def could_open_call(self, body_prefix: str) -> bool:
        """Whether a body starting with `body_prefix` can still be a well-formed call."""
        text = body_prefix.lstrip()
        n = min(len(text), len(self.body_opening))
        return text[:n] == self.body_opening[:n]

    def parse(self, text: str, tools: Sequence[Tool] | None = None) -> ParsedToolCalls:
        """Split a complete generation into content and tool calls."""
        stream = self.stream(tools)
        events = stream.feed(text) + stream.finish()
        return ParsedToolCalls.from_events(events, stream.num_malformed)

    def stream(self, tools: Sequence[Tool] | None = None) -> ToolStreamParser:
        """A parser for one generation that arrives in pieces."""
        return ToolStreamParser(self, tools)


@dataclass(frozen=True)
class ChoiceCall:
    """A forced call whose only freedom is one argument's value, picked from the values its
    schema lists: the call's text before and after that choice (`before + choice + after` is
    the whole call, as the template writes it) and each value's part that tells it apart."""

    before: str
    after: str
    choices: tuple[str, ...]

    def complete(self, text: str) -> str | None:
        """The whole call when `text` (what the model wrote after `before`) is one of the
        choices, else None."""
        return self.before + text + self.after if text in self.choices else None


def choice_call(parser: ToolParser, name: str, parameters: Mapping[str, Any]) -> ChoiceCall | None:
    """The `ChoiceCall` of a forced call of `name` whose parameter schema takes exactly one
    argument, required, nothing else allowed, with two or more listed scalar values (`enum`);
    None for any other schema (the model writes such a call's arguments itself)."""
    properties = parameters.get("properties")
    if (
        parameters.get("type") != "object"
        or not isinstance(properties, Mapping)
        or len(properties) != 1
        or parameters.get("additionalProperties") is not False
    ):
        return None
    [(key, schema)] = properties.items()
    values = schema.get("enum") if isinstance(schema, Mapping) else None
    if list(parameters.get("required") or ()) != [key] or not isinstance(values, list):
        return None
    if not all(isinstance(v, (str, int, bool)) for v in values) or len(set(values)) < 2:
        return None
    written = [parser.write_value(v) for v in values]
    head = os.path.commonprefix(written)
    tails = [w[len(head) :] for w in written]
    tail = os.path.commonprefix([t[::-1] for t in tails])[::-1]
    choices = tuple(t[: len(t) - len(tail)] for t in tails)
    if not all(choices) or len(set(choices)) != len(choices):
        return None  # one value is another's head or tail: keep the written values whole
    before, after = parser.argument_layout(name, key)
    return ChoiceCall(before + head, tail + after, choices)


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolStreamParser:
    """Turns text deltas into content deltas and OpenAI tool-call deltas.

    A call is emitted when its end tag arrives, as two deltas: index, id, type and name with
    empty arguments, then the whole arguments string. Text that may still turn out to be a start
    tag, or whitespace that may turn out to border a call, is held back until it is decided.
    """

    def __init__(self, parser: ToolParser, tools: Sequence[Tool] | None = None) -> None:
        self._parser = parser
        self._schemas = tool_schemas(tools)
        self._buffer = ""  # undecided text: content not yet emitted, or an open call's body
        self._in_call = False
        self._pending_ws = ""  # whitespace after the last content, kept until we know its side
        self._emitted_content = False
        self._call_since_content = False
        self.num_calls = 0
        self.num_malformed = 0

    def feed(self, delta_text: str) -> list[StreamEvent]:
        """Events for the next piece of generated text."""
        self._buffer += delta_text
        return self._drain(final=False)

    def finish(self) -> list[StreamEvent]:
        """Events for what is still held once generation has ended."""
        events = self._drain(final=True)
        if self._pending_ws and not self._call_since_content:
            events.append(ContentDelta(self._pending_ws))
        self._pending_ws = ""
        return events

    def _drain(self, final: bool) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while self._step_call(events, final) if self._in_call else self._step_text(events, final):
            pass
        return events

    def _step_text(self, events: list[StreamEvent], final: bool) -> bool:
        """Emit content up to the next start tag; True when a call was opened."""
        start = self._parser.start_tag
        i = self._buffer.find(start)
        if i >= 0:
            self._emit_text(self._buffer[:i], events)
            self._buffer = self._buffer[i + len(start) :]
            self._in_call = True
            return True
        keep = 0 if final else partial_tag_len(self._buffer, start)
        self._emit_text(self._buffer[: len(self._buffer) - keep], events)
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _step_call(self, events: list[StreamEvent], final: bool) -> bool:
        """Close, reject or keep waiting on the open call; True when it was closed or rejected."""
        end = self._parser.end_tag
        j = self._buffer.find(end)
        if not self._body_can_be_call(j) or (j < 0 and final):
            self._reject_start_tag(events)  # the rest is scanned again as text
            return True
        if j < 0:
            return False
        body, self._buffer = self._buffer[:j], self._buffer[j + len(end) :]
        self._in_call = False
        call = self._parser.parse_call(body, self._schemas)
        if call is None:
            self.num_malformed += 1
            self._emit_text(self._parser.start_tag + body + end, events)
        else:
            self._emit_call(call, events)
        return True

    def _body_can_be_call(self, end_at: int) -> bool:
        """Whether the open call's body seen so far can still be a well-formed call. A second
        start tag inside it means the first call was abandoned and restarted."""
        if end_at >= 0:
            seen = self._buffer[:end_at]
        else:
            # NOTE: the buffer less a partial end tag is a prefix of the final body, so this
            # decides the same way however the text was split into deltas.
            held = partial_tag_len(self._buffer, self._parser.end_tag)
            seen = self._buffer[: len(self._buffer) - held]
        return self._parser.could_open_call(seen) and self._parser.start_tag not in seen

    def _reject_start_tag(self, events: list[StreamEvent]) -> None:
        self.num_malformed += 1
        self._in_call = False
        self._emit_text(self._parser.start_tag, events)

    def _emit_call(self, call: ParsedCall, events: list[StreamEvent]) -> None:
        index = self.num_calls
        self.num_calls += 1
        header = FunctionCallDelta(name=call.name, arguments="")
        events.append(
            ToolCallDelta(index=index, id=new_tool_call_id(), type="function", function=header)
        )
        arguments = FunctionCallDelta(arguments=dump_arguments(call.arguments))
        events.append(ToolCallDelta(index=index, function=arguments))
        self._call_since_content = True

    def _emit_text(self, text: str, events: list[StreamEvent]) -> None:
        """Emit decided content text, holding its trailing whitespace (see the module rules)."""
        self._pending_ws += text
        core = self._pending_ws.strip()
        if not core:
            return
        lead = self._pending_ws[: len(self._pending_ws) - len(self._pending_ws.lstrip())]
        if self._call_since_content and not self._emitted_content:
            lead = ""  # whitespace between the calls so far and the first content
        events.append(ContentDelta(lead + core))
        self._pending_ws = self._pending_ws[len(self._pending_ws.rstrip()) :]
        self._emitted_content = True
        self._call_since_content = False
