"""extract_answer, format_reward and segment_iou."""

from __future__ import annotations

import math

import pytest

from areno.errors import ConfigError
from areno.rewards import RewardError, extract_answer, format_reward, segment_iou


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>dog</answer>", "dog"),
        ("<think>hmm</think>\n<answer>\n  a dog barking \n</answer>", "a dog barking"),
        ("reply as <answer>...</answer>. So: <ANSWER>cat</Answer>", "cat"),  # the last pair
        ("< answer >x</ answer >", "x"),
        ("<answer> <answer>inner</answer>", "inner"),
        ("<answer>multi\nline</answer>", "multi\nline"),
        ("<answer></answer>", ""),
        ("<answer>unclosed", None),
        ("no tags", None),
        ("", None),
        ("<answer>café ☕</answer>", "café ☕"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_other_tag():
    assert extract_answer("<label>3</label><answer>4</answer>", tag="label") == "3"
    with pytest.raises(ConfigError, match="tag must be a name"):
        extract_answer("x", tag="a|b")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>dog</answer>", 1.0),
        ("<think>reasoning</think>\n<answer>dog</answer>\n", 1.0),
        ("<answer>dog</answer> and more", 0.0),  # text after the answer
        ("<answer>  </answer>", 0.0),  # empty answer
        ("<answer>a</answer><answer>b</answer>", 0.0),  # two answers
        ("</answer>dog<answer>", 0.0),  # wrong order
        ("<answer>dog", 0.0),
        ("dog", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward(text, expected):
    assert format_reward(text) == expected


def test_format_reward_other_tag():
    assert format_reward("<label>x</label>", require_tag="label") == 1.0
    assert format_reward("<answer>x</answer>", require_tag="label") == 0.0


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((0, 2), (1, 3), 1 / 3),  # overlap 1, union 3
        ((1.0, 3.0), (1.0, 3.0), 1.0),
        ((0, 10), (2, 4), 0.2),  # contained
        ((0, 1), (1, 2), 0.0),  # touching
        ((0, 1), (5, 6), 0.0),  # disjoint
        ((2, 2), (2, 2), 1.0),  # the same instant
        ((2, 2), (3, 3), 0.0),
        ((2, 2), (0, 4), 0.0),  # an instant inside a segment has no length
    ],
)
def test_segment_iou(a, b, expected):
    assert segment_iou(a, b) == pytest.approx(expected)
    assert segment_iou(b, a) == pytest.approx(expected)


@pytest.mark.parametrize("bad", [(3, 1), (0, math.nan), (0, math.inf), (0,), "ab", (True, 2), None])
def test_segment_iou_refuses_bad_segments(bad):
    with pytest.raises(RewardError, match="segment a"):
        segment_iou(bad, (0, 1))
