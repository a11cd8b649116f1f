"""Shared test helpers: feed text in pieces and compare parse results without their random ids."""

from __future__ import annotations

import json
import random
from typing import Any

from areno.tools import ParsedToolCalls, ToolParser


def random_pieces(text: str, rng: random.Random, max_size: int = 8) -> list[str]:
    """`text` cut into pieces of 1..max_size characters."""
    pieces, pos = [], 0
    while pos < len(text):
        size = rng.randint(1, max_size)
        pieces.append(text[pos : pos + size])
        pos += size
    return pieces


def stream_parse(parser: ToolParser, pieces: list[str], tools: Any = None) -> ParsedToolCalls:
    """Feed `pieces` to a stream parser and accumulate the events as a client does."""
    stream = parser.stream(tools)
    events = [event for piece in pieces for event in stream.feed(piece)] + stream.finish()
    return ParsedToolCalls.from_events(events, stream.num_malformed)


def summary(parsed: ParsedToolCalls) -> tuple[str, list[tuple[str, Any]], int]:
    """Content, (name, decoded arguments) per call, and the malformed count."""
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls]
    return parsed.content, calls, parsed.num_malformed


def assert_stream_matches_parse(parser: ToolParser, text: str, tools: Any = None, seed: int = 0):
    """Streaming in 1-character and random pieces gives what `parse` gives."""
    expected = summary(parser.parse(text, tools))
    rng = random.Random(seed)
    for pieces in [list(text), *(random_pieces(text, rng) for _ in range(3))]:
        assert summary(stream_parse(parser, pieces, tools)) == expected
