"""combine / reward_total: sums, weights, and refusing what is not a reward."""

from __future__ import annotations

import math

import pytest

from areno.errors import ConfigError
from areno.rewards import RewardError, combine, reward_total


def test_sum_and_weighted_sum():
    assert combine({"answer": 1.0, "format": 0.5}) == 1.5
    assert combine({"answer": 1.0, "format": 0.5}, {"format": 0.2}) == pytest.approx(1.1)
    assert combine({"answer": 0.5, "format": 1.0}, {"answer": 2, "format": -1}) == 0.0
    assert combine({}) == 0.0


def test_unknown_weight_and_non_finite_values():
    with pytest.raises(ConfigError, match=r"unknown component\(s\) \['fromat'\]"):
        combine({"format": 1.0}, {"fromat": 0.5})
    with pytest.raises(RewardError, match="'answer' is nan"):
        combine({"answer": math.nan})
    with pytest.raises(RewardError, match="'answer' is True"):
        combine({"answer": True})
    with pytest.raises(ConfigError, match="weight 'answer' is inf"):
        combine({"answer": 1.0}, {"answer": math.inf})


def test_reward_total():
    assert reward_total(0.25) == 0.25
    assert reward_total({"a": 1.0, "b": 2.0}, {"b": 0.5}) == 2.0
    with pytest.raises(RewardError, match="not a finite number"):
        reward_total(None)
    with pytest.raises(ConfigError, match="returned a single float"):
        reward_total(1.0, {"a": 1.0})
