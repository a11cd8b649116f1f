"""Qwen3.5 XML calls, one block per call, one parameter element per argument::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are written raw: a string as its text, anything else as JSON. So a value's type comes from
the tool's schema when it names one ("42" stays a string for a string parameter), and otherwise
a value that reads as a JSON number, boolean, null, array or object takes that type. The value
of a parameter whose schema lists its values (`enum`, `const`) is read without surrounding
whitespace, as a grammar-constrained call may lay it out.
"""

from __future__ import annotations

import json
import re
from typing import Any

from areno.tools.base import NOT_JSON, ParsedCall, ToolParser, ToolSchemas, is_valid_name, try_json

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3XmlToolParser(ToolParser):
    """One `<function=NAME>` element of `<parameter=KEY>` elements per call."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    body_opening = "<function="
    argument_style = "qwen_xml"
    call_closing = "</function>\n</tool_call>"

    def parse_call(self, body: str, schemas: ToolSchemas) -> ParsedCall | None:
        """The call in one `<function=...>...</function>` body, or None."""
        match = _FUNCTION.fullmatch(body)
        if match is None or not is_valid_name(name := match[1].strip()):
            return None
        properties = schemas.get(name, {}).get("properties")
        arguments = _parameters(match[2], properties if isinstance(properties, dict) else {})
        return None if arguments is None else ParsedCall(name, arguments)

    def call_opening(self, name: str) -> str:
        """`<tool_call>` and the `<function=NAME>` line."""
        return f"<tool_call>\n<function={name}>\n"

    def argument_layout(self, name: str, key: str) -> tuple[str, str]:
        """The value on its own line inside its `<parameter=KEY>` element."""
        before = f"{self.call_opening(name)}<parameter={key}>\n"
        return before, f"\n</parameter>\n{self.call_closing}"

    def write_value(self, value: Any) -> str:
        """A string as its text, anything else as JSON."""
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    def forced_prefix(self, name: str | None) -> str:
        """`<tool_call>` up to `<function=`, or with a name its whole `<function=NAME>` line."""
        if name is None:
            return "<tool_call>\n<function="
        return f"<tool_call>\n<function={name}>\n"


def _parameters(inner: str, properties: dict[str, Any]) -> dict[str, Any] | None:
    """Decode the parameters; None when text other than whitespace lies between them or a key
    repeats (which value was meant is unknowable)."""
    arguments: dict[str, Any] = {}
    pos = 0
    for param in _PARAMETER.finditer(inner):
        key = param[1].strip()
        if inner[pos : param.start()].strip() or key in arguments:
            return None
        schema = properties.get(key)
        raw = _strip_layout(param[2])
        if _is_enumerated(schema):  # whitespace around a listed value is layout, not the value
            raw = raw.strip()
        arguments[key] = _value(raw, _schema_types(schema))
        pos = param.end()
    return None if inner[pos:].strip() else arguments


# Whitespace that may lay a value out. The template puts one newline on each side of it; a
# grammar-constrained call (xgrammar's qwen_xml style, at most one whitespace character in a
# row: areno/serve/structured.py) may put any one of these there, and its schema checks (length,
# pattern, enum) hold for the value without them.
LAYOUT = " \t\r\n"


def _strip_layout(raw: str) -> str:
    """`raw` less one layout character on each side: the value's own leading or trailing
    whitespace is inside them."""
    raw = raw[1:] if raw[:1] and raw[0] in LAYOUT else raw
    return raw[:-1] if raw[-1:] and raw[-1] in LAYOUT else raw


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter schema allows ({} when it does not say)."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else declared
    found = {t for t in types if isinstance(t, str)} if isinstance(types, list) else set()
    for combinator in ("anyOf", "oneOf"):
        for option in schema.get(combinator) or ():
            found |= _schema_types(option)
    return found


def _is_enumerated(schema: Any) -> bool:
    """Whether a parameter's schema lists its values (`enum` or `const`)."""
    return isinstance(schema, dict) and ("enum" in schema or "const" in schema)


def _value(raw: str, types: set[str]) -> Any:
    if "string" in types:
        return None if raw == "null" and "null" in types else raw
    decoded = try_json(raw)
    # A JSON string literal here is a raw string that happens to carry quotes: keep the quotes.
    return raw if decoded is NOT_JSON or isinstance(decoded, str) else decoded
