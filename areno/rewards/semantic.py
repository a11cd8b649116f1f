"""A cheap, deterministic "same meaning" score for short free-form answers: no model, no network.

`semantic_match(pred, refs)` scores each reference and keeps the best:

1. 1.0 when the normalised, synonym-canonicalised, stemmed token sequences are equal;
2. 0.0 when exactly one side is negated ("no", "not", "isn't", ...): the opposite answer earns
   no partial credit;
3. 1.0 when the prediction contains every content word of the reference (a token set, so order
   is free: "I think it's a barking dog" matches "dog barking") and adds at most
   `max_extra_words` content words of its own (listing every plausible answer must not pay);
4. otherwise the F1 of the two content-word sets, which is below 1.0.

Content words are the stemmed tokens left after dropping `STOPWORDS` (all tokens when that would
leave none). Stemming is deliberately small: plurals ("puppies" -> "puppy", "boxes" -> "box"),
"-ing" ("barking" -> "bark", "running" -> "run") and a final "e" ("making" ~ "make").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from areno.errors import ConfigError
from areno.rewards.match import as_refs, normalize_text


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


STOPWORDS = frozenset(
    _words(
        "i me my we our you your he him his she her it its they them their this that these those "
        "is are was were be been being am do does did of in on at to for with and or as by from "
        "there here so some just very think believe guess maybe perhaps probably likely seem seems "
        "appear appears look looks like"
    )
)
NEGATIONS = frozenset(
    _words(
        "no not never none nothing nobody neither nor without isnt arent wasnt werent dont doesnt "
        "didnt cant cannot couldnt wont wouldnt shouldnt hasnt havent hadnt"
    )
)
_VOWELS = frozenset("aeiouy")
_NUMBER_WORDS = _words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
)


def stem(word: str) -> str:
    """A small suffix stripper for plurals, "-ing" and a final "e" (see the module docstring)."""
    w = word
    if len(w) > 4 and w.endswith("ies"):
        w = w[:-3] + "y"
    elif w.endswith("sses") or (len(w) > 4 and w.endswith(("ches", "shes", "xes", "zes", "ses"))):
        w = w[:-2]
    elif len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    if len(w) > 5 and w.endswith("ing") and _VOWELS & set(w[:-3]):
        w = w[:-3]
        if w[-1] == w[-2] and w[-1] not in "aeiouylsz":  # "running" -> "run", not "fall"
            w = w[:-1]
    if len(w) > 3 and w.endswith("e"):
        w = w[:-1]
    return w


_STOP_STEMS = frozenset(map(stem, STOPWORDS))


class SynonymTable:
    """Groups of interchangeable phrases: a canonical form and its variants.

    Lookups go both ways (a variant finds its canonical form and vice versa) and ignore case,
    accents, punctuation, articles and plural / "-ing" endings. Extend a table with `add` or
    `update`; merging a group into an existing one is allowed, joining two groups is refused.
    """

    def __init__(self, groups: Mapping[str, Sequence[str]] | None = None) -> None:
        self._groups: dict[str, list[str]] = {}
        self._lookup: dict[tuple[str, ...], str] = {}
        self._max_len = 0
        self.update(groups or {})

    @classmethod
    def default(cls) -> SynonymTable:
        """A table of number words: "0" <-> "zero" up to "20" <-> "twenty"."""
        return cls({str(i): [word] for i, word in enumerate(_NUMBER_WORDS)})

    def add(self, canonical: str, *variants: str) -> SynonymTable:
        """Add `variants` to `canonical`'s group (or to the group `canonical` already belongs to)."""
        target = self._lookup.get(_key(canonical), _normal(canonical))
        group = self._groups.setdefault(target, [])
        for phrase in (target, _normal(canonical), *map(_normal, variants)):
            owner = self._lookup.get(_key(phrase))
            if owner is not None and owner != target:
                raise ConfigError(
                    f"synonym {phrase!r} already belongs to {owner!r}; it cannot also join {target!r}"
                )
            if owner is None:
                self._lookup[_key(phrase)] = target
                self._max_len = max(self._max_len, len(_key(phrase)))
                if phrase != target:
                    group.append(phrase)
        return self

    def update(self, groups: Mapping[str, Sequence[str]]) -> SynonymTable:
        """`add` each canonical form with its variants."""
        for canonical, variants in groups.items():
            if isinstance(variants, str):
                raise ConfigError(
                    f"variants of {canonical!r} must be a list, not the string {variants!r}"
                )
            self.add(canonical, *variants)
        return self

    def canonical(self, term: str) -> str | None:
        """The canonical form of `term`'s group (normalised), or None when `term` is unknown."""
        return self._lookup.get(_key(term))

    def variants(self, term: str) -> tuple[str, ...]:
        """Every phrase in `term`'s group, the canonical form first; () when `term` is unknown."""
        canonical = self.canonical(term)
        return () if canonical is None else (canonical, *self._groups[canonical])

    def canonicalize(self, text: str) -> str:
        """`normalize_text(text)` with every known phrase (longest first) replaced by its
        canonical form."""
        tokens = normalize_text(text).split()
        stems = [stem(t) for t in tokens]
        out, i = [], 0
        while i < len(tokens):
            for n in range(min(self._max_len, len(tokens) - i), 0, -1):
                if (canonical := self._lookup.get(tuple(stems[i : i + n]))) is not None:
                    out.append(canonical)
                    i += n
                    break
            else:
                out.append(tokens[i])
                i += 1
        return " ".join(out)

    def copy(self) -> SynonymTable:
        """An independent table with the same groups."""
        return SynonymTable(self.as_dict())

    def as_dict(self) -> dict[str, list[str]]:
        """canonical -> variants, normalised."""
        return {canonical: list(variants) for canonical, variants in self._groups.items()}

    def __contains__(self, term: object) -> bool:
        return isinstance(term, str) and self.canonical(term) is not None

    def __len__(self) -> int:
        return len(self._groups)

    def __repr__(self) -> str:
        return f"SynonymTable({self.as_dict()!r})"


def _normal(phrase: str) -> str:
    normal = normalize_text(phrase)
    if not normal:
        raise ConfigError(
            f"synonym {phrase!r} is empty once normalised (only punctuation/articles)"
        )
    return normal


def _key(phrase: str) -> tuple[str, ...]:
    return tuple(stem(t) for t in normalize_text(phrase).split())


def semantic_match(
    pred: str,
    refs: str | Sequence[str],
    synonyms: Mapping[str, Sequence[str]] | SynonymTable | None = None,
    *,
    max_extra_words: int | None = 3,
) -> float:
    """How well `pred` means one of `refs`, in [0, 1]; 1.0 is a match (see the module docstring).

    Args:
        pred: the model's answer.
        refs: one reference answer or several; the best-scoring one counts.
        synonyms: a `SynonymTable`, or a canonical -> variants mapping to build one from.
        max_extra_words: content words the prediction may add and still match in full;
            None for no limit.

    Raises:
        RewardError: no references, or a reference that is not a string.
    """
    refs = as_refs(refs)
    if max_extra_words is not None and max_extra_words < 0:
        raise ConfigError(f"max_extra_words must be >= 0 or None, got {max_extra_words}")
    table = (
        synonyms
        if isinstance(synonyms, SynonymTable) or synonyms is None
        else SynonymTable(synonyms)
    )
    p = _Analysis.of(pred, table)
    if not p.tokens:
        return 0.0
    return max(_score(p, _Analysis.of(r, table), max_extra_words) for r in refs)


@dataclass(frozen=True)
class _Analysis:
    tokens: tuple[str, ...]
    content: frozenset[str]
    negated: bool

    @classmethod
    def of(cls, text: str, table: SynonymTable | None) -> _Analysis:
        words = (table.canonicalize(text) if table else normalize_text(text)).split()
        tokens = tuple(stem(w) for w in words)
        content = frozenset(t for t in tokens if t not in _STOP_STEMS) or frozenset(tokens)
        return cls(tokens, content, negated=not NEGATIONS.isdisjoint(words))


def _score(p: _Analysis, r: _Analysis, max_extra_words: int | None) -> float:
    if not r.tokens:
        return 0.0
    if p.tokens == r.tokens:
        return 1.0
    if p.negated != r.negated:
        return 0.0
    extra = len(p.content - r.content)
    if r.content <= p.content and (max_extra_words is None or extra <= max_extra_words):
        return 1.0
    return _f1(p.content, r.content)


def _f1(pred: Iterable[str], ref: Iterable[str]) -> float:
    pred, ref = set(pred), set(ref)
    overlap = len(pred & ref)
    if not overlap:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)
