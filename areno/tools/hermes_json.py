"""Hermes-style JSON calls, used by Qwen3-VL and MiniCPM-V.

`<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, one block per call.
"""

from __future__ import annotations

import json
from typing import Any

from areno.tools.base import NOT_JSON, ParsedCall, ToolParser, ToolSchemas, is_valid_name, try_json


class HermesJsonToolParser(ToolParser):
    """One JSON object per call. `arguments` may also come as a JSON-encoded string, as some
    fine-tunes write it, or be absent for a call without arguments."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    body_opening = "{"
    call_closing = "}\n</tool_call>"

    def parse_call(self, body: str, schemas: ToolSchemas) -> ParsedCall | None:
        """The call in one `{"name": ..., "arguments": ...}` body, or None."""
        obj = try_json(body.strip())
        if not isinstance(obj, dict) or not is_valid_name(obj.get("name")):
            return None
        arguments = _arguments(obj.get("arguments", {}))
        return None if arguments is None else ParsedCall(obj["name"], arguments)

    def call_opening(self, name: str) -> str:
        """`<tool_call>` and the object up to its arguments' value."""
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": '

    def argument_layout(self, name: str, key: str) -> tuple[str, str]:
        """`{"KEY": VALUE}` as the arguments' value, written as `json.dumps` writes it."""
        return f"{self.call_opening(name)}{{{json.dumps(key)}: ", f"}}{self.call_closing}"

    def forced_prefix(self, name: str | None) -> str:
        """`<tool_call>` and the object up to the name's opening quote, or with a name up to
        `"arguments":` (the template writes the name first)."""
        if name is None:
            return '<tool_call>\n{"name": "'
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments":'


def _arguments(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):
        value = try_json(value)
    if value is NOT_JSON or not isinstance(value, dict):
        return None
    return value
