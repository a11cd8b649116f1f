"""Gemma 4 calls: `<|tool_call>call:NAME{ARGS}<tool_call|>`.

AReno's own Gemma 4 template writes ARGS as JSON. Google's released template writes them in its
own notation, with bare keys and strings fenced by `<|"|>` (`{city:<|"|>Paris<|"|>,days:3}`);
both are read, so real checkpoints parse too.
"""

from __future__ import annotations

import json
import re
from typing import Any

from areno.tools.base import NOT_JSON, ParsedCall, ToolParser, ToolSchemas, is_valid_name, try_json

_CALL = re.compile(r"\s*call:([^{\s]+)\s*(\{.*\})\s*", re.DOTALL)
_QUOTE = '<|"|>'


class Gemma4ToolParser(ToolParser):
    """`call:NAME` followed by one object of arguments."""

    start_tag = "<|tool_call>"
    end_tag = "<tool_call|>"
    body_opening = "call:"
    # Google's own notation, which real checkpoints write (the parser reads JSON too).
    argument_style = "gemma"
    call_closing = "<tool_call|>"

    def parse_call(self, body: str, schemas: ToolSchemas) -> ParsedCall | None:
        """The call in one `call:NAME{...}` body, or None."""
        match = _CALL.fullmatch(body)
        if match is None or not is_valid_name(match[1]):
            return None
        arguments = try_json(match[2])
        if arguments is NOT_JSON:
            arguments = _read_native(match[2])
        return ParsedCall(match[1], arguments) if isinstance(arguments, dict) else None

    def call_opening(self, name: str) -> str:
        """`<|tool_call>call:NAME`; the arguments object follows at once."""
        return f"{self.start_tag}call:{name}"

    def argument_layout(self, name: str, key: str) -> tuple[str, str]:
        """`{KEY:VALUE}` in Google's notation: a bare key, no space."""
        return f"{self.call_opening(name)}{{{key}:", f"}}{self.call_closing}"

    def write_value(self, value: Any) -> str:
        """A string fenced by `<|"|>`, anything else as JSON."""
        return f"{_QUOTE}{value}{_QUOTE}" if isinstance(value, str) else json.dumps(value)

    def forced_prefix(self, name: str | None) -> str:
        """`<|tool_call>call:`, then the name when there is one (its arguments follow)."""
        return f"{self.start_tag}call:{name or ''}"


def _read_native(text: str) -> Any:
    """Decode Gemma's native argument notation; None when it does not parse."""
    reader = _NativeReader(text)
    try:
        value = reader.value()
        reader.skip_space()
    except (ValueError, IndexError, RecursionError):
        return None
    return value if reader.pos == len(text) else None


class _NativeReader:
    """Recursive descent over `{key:value,...}`, `[...]`, `<|"|>text<|"|>`, JSON strings and
    bare scalars (numbers, true/false/null, or unquoted text)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def value(self) -> Any:
        self.skip_space()
        char = self.text[self.pos]
        if char == "{":
            return self._object()
        if char == "[":
            return self._array()
        if self._at_string():
            return self._string()
        token = self._until(",}]")
        decoded = try_json(token)
        return token if decoded is NOT_JSON or isinstance(decoded, str) else decoded

    def _object(self) -> dict[str, Any]:
        self.pos += 1
        result: dict[str, Any] = {}
        while not self._close("}"):
            self.skip_space()
            key = self._string() if self._at_string() else self._until(":")
            self.skip_space()
            self._expect(":")
            result[key] = self.value()
            self._separator("}")
        return result

    def _array(self) -> list[Any]:
        self.pos += 1
        result: list[Any] = []
        while not self._close("]"):
            result.append(self.value())
            self._separator("]")
        return result

    def _at_string(self) -> bool:
        return self.text.startswith(_QUOTE, self.pos) or self.text[self.pos] == '"'

    def _string(self) -> str:
        if self.text.startswith(_QUOTE, self.pos):
            end = self.text.index(_QUOTE, self.pos + len(_QUOTE))  # ValueError when unclosed
            value, self.pos = self.text[self.pos + len(_QUOTE) : end], end + len(_QUOTE)
            return value
        value = try_json(self._json_string_span())
        if not isinstance(value, str):
            raise ValueError("bad string")
        return value

    def _json_string_span(self) -> str:
        end = self.pos + 1
        while self.text[end] != '"':  # IndexError when unclosed
            end += 2 if self.text[end] == "\\" else 1
        span, self.pos = self.text[self.pos : end + 1], end + 1
        return span

    def _until(self, stops: str) -> str:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in stops:
            self.pos += 1
        token = self.text[start : self.pos].strip()
        if not token:
            raise ValueError(f"empty token at {start}")
        return token

    def _close(self, bracket: str) -> bool:
        self.skip_space()
        if self.text[self.pos] == bracket:
            self.pos += 1
            return True
        return False

    def _separator(self, bracket: str) -> None:
        self.skip_space()
        if self.text[self.pos] == ",":
            self.pos += 1
        elif self.text[self.pos] != bracket:
            raise ValueError(f"expected ',' or {bracket!r} at {self.pos}")

    def _expect(self, char: str) -> None:
        if self.text[self.pos] != char:
            raise ValueError(f"expected {char!r} at {self.pos}")
        self.pos += 1
