"""Output-format rewards: `<answer>...</answer>` extraction and checking, and temporal IoU."""

from __future__ import annotations

import math
import re
from functools import lru_cache
from numbers import Real

from areno.errors import ConfigError
from areno.rewards.base import RewardError

_TAG_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


@lru_cache(maxsize=32)
def _tag_patterns(tag: str) -> tuple[re.Pattern[str], re.Pattern[str], re.Pattern[str]]:
    if not isinstance(tag, str) or not _TAG_NAME.match(tag):
        raise ConfigError(f"tag must be a name such as 'answer', got {tag!r}")
    name = re.escape(tag)
    opening, closing = rf"<\s*{name}\s*>", rf"<\s*/\s*{name}\s*>"
    # The innermost pair: no opening tag between the one matched and its closing tag.
    pair = re.compile(rf"{opening}((?:(?!{opening}).)*?){closing}", re.IGNORECASE | re.DOTALL)
    return pair, re.compile(opening, re.IGNORECASE), re.compile(closing, re.IGNORECASE)


def extract_answer(text: str, tag: str = "answer") -> str | None:
    """The stripped content of the last complete `<tag>...</tag>` pair, or None when there is none.

    The last pair counts because models often quote the format while reasoning, before answering.
    Tag names match case-insensitively and allow spaces inside the brackets (`< answer >`).
    """
    pair, _, _ = _tag_patterns(tag)
    matches = pair.findall(text)
    return matches[-1].strip() if matches else None


def format_reward(text: str, *, require_tag: str = "answer") -> float:
    """1.0 when `text` holds exactly one `<tag>...</tag>` pair, in that order, with non-empty
    content and nothing but whitespace after it; else 0.0."""
    pair, opening, closing = _tag_patterns(require_tag)
    if len(opening.findall(text)) != 1 or len(closing.findall(text)) != 1:
        return 0.0
    match = pair.search(text)
    if match is None or not match.group(1).strip() or text[match.end() :].strip():
        return 0.0
    return 1.0


def segment_iou(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Temporal IoU of two `(start, end)` segments, in [0, 1].

    Two zero-length segments score 1.0 when they are the same instant, else 0.0.

    Raises:
        RewardError: a segment is not two finite numbers with start <= end (parse and check a
            model's segment before scoring it).
    """
    (a0, a1), (b0, b1) = _segment(a, "a"), _segment(b, "b")
    intersection = max(0.0, min(a1, b1) - max(a0, b0))
    union = (a1 - a0) + (b1 - b0) - intersection
    if union == 0.0:
        return 1.0 if (a0, a1) == (b0, b1) else 0.0
    return intersection / union


def _segment(seg: tuple[float, float], name: str) -> tuple[float, float]:
    try:
        start, end = seg
    except (TypeError, ValueError):
        raise RewardError(f"segment {name} must be a (start, end) pair, got {seg!r}") from None
    for value in (start, end):
        if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value):
            raise RewardError(f"segment {name} {seg!r}: {value!r} is not a finite number")
    if end < start:
        raise RewardError(f"segment {name} {seg!r} ends before it starts")
    return float(start), float(end)
