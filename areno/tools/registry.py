"""The tool-call parser of each `FamilyAdapter.tool_format`."""

from __future__ import annotations

from areno.errors import ConfigError
from areno.tools.base import ToolParser
from areno.tools.gemma4 import Gemma4ToolParser
from areno.tools.hermes_json import HermesJsonToolParser
from areno.tools.qwen3_xml import Qwen3XmlToolParser

_PARSERS: dict[str, type[ToolParser]] = {
    "qwen3_xml": Qwen3XmlToolParser,
    "hermes_json": HermesJsonToolParser,
    "gemma4": Gemma4ToolParser,
}


def supported_tool_formats() -> list[str]:
    """The tool_format names that have a parser."""
    return sorted(_PARSERS)


def get_tool_parser(tool_format: str) -> ToolParser:
    """The parser for `tool_format` (a FamilyAdapter's tool_format)."""
    try:
        return _PARSERS[tool_format]()
    except KeyError:
        raise ConfigError(
            f"no tool-call parser for tool_format {tool_format!r}; supported formats: "
            f"{', '.join(supported_tool_formats())}. Add one in areno/tools/ and register it in "
            "areno/tools/registry.py"
        ) from None
