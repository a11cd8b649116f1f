"""Tool-call parsers: a model's generated text to OpenAI `message.tool_calls`, whole or streamed.

`get_tool_parser(adapter.tool_format)` gives the loaded family's parser; `parse(text, tools)`
splits a complete generation, `stream(tools)` gives a `ToolStreamParser` for deltas.
`reasoning` splits a thinking checkpoint's `<think>` block off the reply before that parsing.
"""

from areno.tools.base import (
    ChoiceCall,
    ContentDelta,
    ParsedToolCalls,
    StreamEvent,
    ToolParser,
    ToolStreamParser,
    choice_call,
)
from areno.tools.reasoning import ReasoningStream, opens_reasoning, split_reasoning
from areno.tools.registry import get_tool_parser, supported_tool_formats

__all__ = [
    "ChoiceCall",
    "ContentDelta",
    "ParsedToolCalls",
    "ReasoningStream",
    "StreamEvent",
    "ToolParser",
    "ToolStreamParser",
    "choice_call",
    "get_tool_parser",
    "opens_reasoning",
    "split_reasoning",
    "supported_tool_formats",
]
