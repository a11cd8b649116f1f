"""The private data guard: a sample's private values must not show on its public side.

`Sample.private` reaches only the reward; the policy, the tools and the logs see the public
messages, the media references in them and the tool schemas. A reference answer written into
any of those (a label in a file name, an answer in the question's text) lets the policy read
what it is rewarded for guessing. `check_private` searches every private string value of
`MIN_CHARS` or more characters, as a whole word (case-insensitive), in the text parts, the
media URLs (paths and file names; a data URL's payload is not read) and the tool schemas, and
raises `PrivateDataLeakError` naming the sample, the private key and where the value showed.

Values a sample shows by design (the options its question lists, a tool's enum of them) are
declared in its private `PUBLIC_VALUES` list and skipped in text and tool schemas, never in
media references: a file named after one option pairs that option with this sample.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from areno.data.sample import Sample, SampleError

MIN_CHARS = 3
PUBLIC_VALUES = "public_values"  # the private key listing values that are public by design


class PrivateDataLeakError(SampleError):
    """A private value of a sample shows on its public side (messages, media, tools)."""

    code = "private_data_leak"


def check_private(sample: Sample) -> None:
    """Raise PrivateDataLeakError when a private string value shows on `sample`'s public side."""
    allowed = {str(v).casefold() for v in sample.private.get(PUBLIC_VALUES, ())}
    places = list(_public_places(sample))
    for key, value in _private_strings(sample.private):
        if len(value) < MIN_CHARS:
            continue
        shown = value.casefold() in allowed
        pattern = re.compile(rf"(?<![0-9A-Za-z]){re.escape(value)}(?![0-9A-Za-z])", re.I)
        for where, text, is_media in places:
            if (is_media or not shown) and pattern.search(text):
                raise PrivateDataLeakError(
                    f"sample {sample.id!r}: private[{key!r}] ({len(value)} characters) shows in "
                    f"its {where}; the policy and its tools would read it. Remove it there, or "
                    f"list it in private[{PUBLIC_VALUES!r}] if it is public by design",
                    param=key,
                )


def _private_strings(value: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """(key path, string) of every string in the private data, nested ones included."""
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for name, item in value.items():
            if not key and name == PUBLIC_VALUES:
                continue
            yield from _private_strings(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _private_strings(item, f"{key}[{i}]")


def _public_places(sample: Sample) -> Iterator[tuple[str, str, bool]]:
    """(where, text, whether it is a media reference) of everything the public side shows."""
    for m, message in enumerate(sample.messages):
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        for p, part in enumerate(parts):
            if part.get("type") == "text":
                yield f"message {m}'s text", str(part.get("text", "")), False
                continue
            # NOTE: the place, not the URL: the error is logged, and the URL holds the value.
            for url in _urls(part):
                yield f"message {m}'s media reference (content part {p})", _shown(url), True
    if sample.tools:
        yield "tool schemas", json.dumps(sample.tools), False


def _urls(part: dict) -> Iterator[str]:
    """A content part's media URLs: `{"image_url": {"url": ...}}` and the direct forms."""
    for value in [part, *part.values()]:
        if isinstance(value, dict) and isinstance(value.get("url"), str):
            yield value["url"]


def _shown(url: str) -> str:
    """What a media reference shows: a data URL's header only, else all of it."""
    return url.split(",", 1)[0] if url.startswith("data:") else url
