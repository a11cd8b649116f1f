"""String-match rewards: exact, and after SQuAD-style normalisation."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

from areno.rewards.base import RewardError

ARTICLES = frozenset({"a", "an", "the"})
# Apostrophes join ("don't" -> "dont"); other punctuation separates ("dog-barking" -> "dog barking").
_APOSTROPHES = frozenset("'\u2019\u02bc\u2018`")
# A decimal point stays ("3.5"); a thousands comma goes ("1,000" -> "1000").
_DECIMAL_POINT = re.compile(r"(?<=\d)\.(?=\d)")
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_KEEP_POINT = "\x00"


def normalize_text(s: str) -> str:
    """Casefold, strip accents (NFKD), drop punctuation and the articles a/an/the, and collapse
    whitespace: `"  The Café's  DOG-barking!"` -> `"cafes dog barking"`.

    Numbers keep their decimal point and lose thousands commas (`"1,000.5"` -> `"1000.5"`).
    """
    s = _THOUSANDS_COMMA.sub("", s)
    s = _DECIMAL_POINT.sub(_KEEP_POINT, s)
    # NFKD on both sides of casefold: compatibility forms such as "ℌ" only lower once decomposed.
    s = unicodedata.normalize("NFKD", unicodedata.normalize("NFKD", s).casefold())
    chars = []
    for ch in s:
        if ch in _APOSTROPHES or unicodedata.combining(ch):
            continue
        chars.append(" " if unicodedata.category(ch).startswith("P") else ch)
    tokens = "".join(chars).replace(_KEEP_POINT, ".").split()
    return " ".join(t for t in tokens if t not in ARTICLES)


def exact_match(pred: str, ref: str) -> float:
    """1.0 when `pred` equals `ref` after stripping surrounding whitespace, else 0.0."""
    return 1.0 if pred.strip() == ref.strip() else 0.0


def normalized_match(pred: str, refs: str | Sequence[str]) -> float:
    """1.0 when `normalize_text(pred)` equals that of any reference, else 0.0.

    A prediction that normalises to "" (empty, only punctuation or articles) scores 0.0.
    """
    p = normalize_text(pred)
    if not p:
        return 0.0
    return 1.0 if any(p == normalize_text(r) for r in as_refs(refs)) else 0.0


def as_refs(refs: str | Sequence[str]) -> list[str]:
    """One reference or several, as a list; refuses none, or a non-string among them."""
    refs = [refs] if isinstance(refs, str) else list(refs)
    if not refs:
        raise RewardError("no reference answers given; a sample needs at least one")
    if bad := [r for r in refs if not isinstance(r, str)]:
        raise RewardError(f"reference answers must be strings, got {type(bad[0]).__name__}")
    return refs
