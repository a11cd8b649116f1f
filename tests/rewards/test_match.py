"""normalize_text, exact_match, normalized_match: hand-checked values and edge cases."""

from __future__ import annotations

import pytest

from areno.rewards import RewardError, exact_match, normalize_text, normalized_match


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("  The Café's  DOG-barking!", "cafes dog barking"),
        ("An apple, a pear & the end.", "apple pear end"),
        ("$5 + 3 = 8", "$5 + 3 = 8"),  # symbols are not punctuation
        ("Straße", "strasse"),
        ("Ｆｕｌｌｗｉｄｔｈ ＡＢＣ", "fullwidth abc"),
        ("naïve résumé", "naive resume"),
        ("don’t stop", "dont stop"),
        ("1,000.5 km; 3.5", "1000.5 km 3.5"),
        ("«quoted» — “text”", "quoted text"),
        ("theatre another", "theatre another"),
        ("", ""),
        ("   ", ""),
        ("?!...", ""),
        ("The a an", ""),
        ("line\nbreak\ttab", "line break tab"),
    ],
)
def test_normalize_text(text, expected):
    assert normalize_text(text) == expected


def test_exact_match():
    assert exact_match("Dog", "Dog") == 1.0
    assert exact_match("  Dog\n", "Dog") == 1.0
    assert exact_match("dog", "Dog") == 0.0
    assert exact_match("", "") == 1.0


def test_normalized_match():
    assert normalized_match("The DOG.", "dog") == 1.0
    assert normalized_match("a dog", ["cat", "Dog!"]) == 1.0
    assert normalized_match("dogs", "dog") == 0.0
    assert normalized_match("Café", "cafe") == 1.0


def test_empty_prediction_never_matches():
    assert normalized_match("", "") == 0.0
    assert normalized_match("the...", ["the", ""]) == 0.0


def test_references_are_checked():
    with pytest.raises(RewardError, match="no reference answers"):
        normalized_match("dog", [])
    with pytest.raises(RewardError, match="must be strings, got int"):
        normalized_match("4", [4])
