"""The private data guard: a sample's private values must not show on its public side.

`Sample.private` reaches only the reward; the policy, the tools and the logs see the public
messages (every string of them: text, tool-call names and arguments, tool results), the media
references in them and the tool schemas. A reference answer written into any of those (a label
in a file name, an answer in the question's text or in an earlier turn's tool call) lets the
policy read what it is rewarded for guessing. `check_private` looks for every private scalar
(strings; numbers by their text, `3.0` also as `3`; booleans as `true` / `false`), however
short, as a whole run of words (case-insensitive): in text, words are what non-alphanumeric
characters separate; a media reference is URL-decoded first (`red%20car.png`) and, for a value
of three characters or more, also split at camel-case and letter/digit boundaries
(`clipViolin01.png` shows "violin"); a data URL's payload is not read. A string is looked for in
the whole reference (a class-per-folder layout names the label in a directory), a number or a
string of one or two characters in its file name only (directories are full of run numbers,
versions, dates and short words that name nothing). It raises
`PrivateDataLeakError` naming the sample, the private key and where the value showed, never the
value.

Values a sample shows by design (the options its question lists, a tool's enum of them, the
clip length the question states) are declared in its private `PUBLIC_VALUES` list and skipped
in text and tool schemas, never in media references: a file named after one option pairs that
option with this sample. Nothing is skipped for being short.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Iterator
from typing import Any

from areno.data.sample import Sample, SampleError

PUBLIC_VALUES = "public_values"  # the private key listing values that are public by design


class PrivateDataLeakError(SampleError):
    """A private value of a sample shows on its public side (messages, media, tools)."""

    code = "private_data_leak"


def check_private(sample: Sample) -> None:
    """Raise PrivateDataLeakError when a private value shows on `sample`'s public side."""
    allowed = {_words(text) for v in sample.private.get(PUBLIC_VALUES, ()) for text in _texts(v)}
    places = [
        (where, is_media, _words(text), _words(text, split=True), _words(_file_name(text)))
        for where, text, is_media in _public_places(sample)
    ]
    for key, value in _private_scalars(sample.private):
        for text in _texts(value):
            words = _words(text)
            if not words:
                continue
            long = isinstance(value, str) and len(text) >= SPLIT_MIN_CHARS
            shown = words in allowed
            for where, is_media, whole, pieces, name in places:
                if not is_media:
                    hit = not shown and _contains(whole, words)
                elif long:
                    hit = _contains(whole, words) or _contains(pieces, _words(text, split=True))
                else:
                    hit = _contains(name, words)
                if hit:
                    raise PrivateDataLeakError(
                        f"sample {sample.id!r}: private[{key!r}] ({len(text)} characters) shows "
                        f"in its {where}; the policy and its tools would read it. Remove it "
                        f"there, or list it in private[{PUBLIC_VALUES!r}] if it is public by "
                        "design",
                        param=key,
                    )


def _file_name(reference: str) -> str:
    """The last path segment of a media reference."""
    return reference.rstrip("/").rsplit("/", 1)[-1]


# A string this long is also looked for in a media reference's camel-case and letter/digit
# pieces and its directories; a shorter one (and a number) only as a whole word of its file
# name (a hash in a file name is full of short pieces, a path of short words, that name
# nothing).
SPLIT_MIN_CHARS = 3
_CAMEL = re.compile(
    r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])|(?<=[A-Za-z])(?=[0-9])|(?<=[0-9])(?=[A-Za-z])"
)
# A decimal number is one word (`3.5` does not show `3`).
_WORD = re.compile(r"\d+(?:\.\d+)+|[^\W_]+")


def _words(text: str, split: bool = False) -> tuple[str, ...]:
    """The words of `text`, case-folded; `split`: camel-case and letter/digit pieces too."""
    if split:
        text = _CAMEL.sub(" ", text)
    return tuple(word.casefold() for word in _WORD.findall(text))


def _contains(words: tuple[str, ...], run: tuple[str, ...]) -> bool:
    """Whether `run` occurs in `words` as consecutive words."""
    n = len(run)
    return any(words[i : i + n] == run for i in range(len(words) - n + 1))


def _texts(value: Any) -> list[str]:
    """How a private scalar may be written: a string as it is, a bool as JSON writes it, a
    number by its text (an integral float also without its `.0`)."""
    if isinstance(value, bool):
        return [json.dumps(value)]
    if isinstance(value, int):
        return [str(value)]
    if isinstance(value, float):
        return [repr(value), str(int(value))] if value.is_integer() else [repr(value)]
    return [value] if isinstance(value, str) else []


def _private_scalars(value: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """(key path, value) of every scalar in the private data, nested ones included."""
    if isinstance(value, dict):
        for name, item in value.items():
            if not key and name == PUBLIC_VALUES:
                continue
            yield from _private_scalars(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _private_scalars(item, f"{key}[{i}]")
    elif value is not None:
        yield key, value


# Keys of a message whose values are its shape, not its content.
_STRUCTURE = ("role", "type")


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
        rest = {k: v for k, v in message.items() if k != "content" and k not in _STRUCTURE}
        for path, text in _strings(rest):
            yield f"message {m}'s {path}", text, False
    if sample.tools:
        yield "tool schemas", json.dumps(sample.tools, ensure_ascii=False), False


def _strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(JSON path, text) of every string and number in a message's other fields (tool calls
    and their arguments, names, reasoning)."""
    if isinstance(value, dict):
        for name, item in value.items():
            yield from _strings(item, f"{path}.{name}" if path else str(name))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _strings(item, f"{path}[{i}]")
    elif isinstance(value, str | int | float) and not isinstance(value, bool):
        yield path, str(value)


def _urls(part: dict) -> Iterator[str]:
    """A content part's media URLs: `{"image_url": {"url": ...}}` and the direct forms."""
    for value in [part, *part.values()]:
        if isinstance(value, dict) and isinstance(value.get("url"), str):
            yield value["url"]


def _shown(url: str) -> str:
    """What a media reference shows: a data URL's header only, else all of it, URL-decoded."""
    return url.split(",", 1)[0] if url.startswith("data:") else urllib.parse.unquote(url)
