"""semantic_match, stem and SynonymTable: hand-computed scores and the rules that guard them."""

from __future__ import annotations

import pytest

from areno.errors import ConfigError
from areno.rewards import RewardError, SynonymTable, semantic_match, stem


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("barking", "bark"),
        ("running", "run"),
        ("falling", "fall"),
        ("puppies", "puppy"),
        ("boxes", "box"),
        ("watches", "watch"),
        ("dogs", "dog"),
        ("glass", "glass"),
        ("bus", "bus"),
        ("making", "mak"),
        ("make", "mak"),
        ("spring", "spring"),
        ("thing", "thing"),
    ],
)
def test_stem(word, expected):
    assert stem(word) == expected


@pytest.mark.parametrize(
    ("pred", "ref", "expected"),
    [
        ("Dog barking.", "dog barking", 1.0),  # normalised equality
        ("dogs bark", "dog barking", 1.0),  # plural and -ing stemming
        ("I think it's a barking dog", "dog barking", 1.0),  # containment, order free
        ("sounds like a dog barking loudly", "dog barking", 1.0),  # 2 extra content words
        ("cat barking", "dog barking", 0.5),  # F1: p = r = 1/2
        ("dog", "dog barking", 2 / 3),  # F1: p = 1, r = 1/2
        ("dog cat bird car barking", "dog barking", 1.0),  # 3 extras: the limit
        ("dog cat bird car horse barking", "dog barking", 0.5),  # 4 extras: p = 1/3, r = 1
        ("not a dog", "dog", 0.0),  # negated prediction: no credit
        ("it isn't barking", "dog barking", 0.0),
        ("no dog", "no dog", 1.0),
        ("nothing", "silence", 0.0),
        ("piano", "dog barking", 0.0),
        ("", "dog", 0.0),
        ("the ...", "dog", 0.0),
        ("café music", "Cafe MUSIC!", 1.0),  # accents, case, punctuation
    ],
)
def test_semantic_match(pred, ref, expected):
    assert semantic_match(pred, ref) == pytest.approx(expected)


def test_partial_scores_stay_below_one():
    for pred in ("dog barking cat", "barking", "dog barking cat bird car horse"):
        score = semantic_match(pred, "dog barking cat car", max_extra_words=0)
        assert 0.0 <= score <= 1.0
    assert semantic_match("barking dog in park", "dog barking", max_extra_words=0) == 0.8
    assert semantic_match("a b c d e f g dog barking", "dog barking", max_extra_words=None) == 1.0
    with pytest.raises(ConfigError, match="max_extra_words"):
        semantic_match("dog", "dog", max_extra_words=-1)


def test_best_reference_counts():
    assert semantic_match("cat", ["dog", "a cat", "bird"]) == 1.0
    assert semantic_match("cat barking", ["bird", "dog barking"]) == 0.5
    with pytest.raises(RewardError, match="no reference answers"):
        semantic_match("dog", [])


def test_synonyms_apply_both_ways_and_inside_phrases():
    synonyms = {"dog": ["puppy", "Hound"], "automobile": ["car"]}
    assert semantic_match("a puppy barking", "dog barking") == 0.5
    assert semantic_match("a puppy barking", "dog barking", synonyms) == 1.0
    assert semantic_match("puppies", "hound", synonyms) == 1.0
    assert semantic_match("an automobile", "car", SynonymTable(synonyms)) == 1.0
    assert semantic_match("two dogs", "2 dogs", SynonymTable.default()) == 1.0


def test_synonym_table_lookups():
    table = SynonymTable({"Dog": ["puppy", "hound"]})
    table.add("ice cream", "gelato").add("puppy", "pup")  # "puppy" joins its existing group
    assert table.canonical("PUPPIES") == "dog"
    assert table.canonical("dog") == "dog"
    assert table.canonical("cat") is None
    assert table.variants("hound") == ("dog", "puppy", "hound", "pup")
    assert table.variants("cat") == ()
    assert "Gelato" in table and "sorbet" not in table
    assert len(table) == 2
    assert table.canonicalize("The pups love Gelato!") == "dog love ice cream"


def test_synonym_table_refuses_joining_groups_and_bad_input():
    table = SynonymTable({"dog": ["puppy"], "cat": ["kitten"]})
    with pytest.raises(ConfigError, match="'kitten' already belongs to 'cat'"):
        table.add("dog", "kitten")
    with pytest.raises(ConfigError, match="must be a list"):
        SynonymTable({"dog": "puppy"})
    with pytest.raises(ConfigError, match="empty once normalised"):
        SynonymTable({"dog": ["the"]})
    copy = table.copy()
    copy.add("bird", "sparrow")
    assert "sparrow" not in table
