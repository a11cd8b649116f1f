"""The reward function contract's types, and combining named reward components into one total."""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from typing import Any, Protocol

from areno.errors import ArenoError, ConfigError

RewardValue = float | dict[str, float]


class RewardError(ArenoError):
    """A reward function got input it cannot score, or returned a value that is not a reward."""

    code = "invalid_reward"


class RewardFn(Protocol):
    """`reward(trajectory, private) -> float | dict[str, float]` (see `areno.rewards`)."""

    def __call__(self, trajectory: Any, private: dict, /) -> RewardValue: ...


def combine(components: Mapping[str, float], weights: Mapping[str, float] | None = None) -> float:
    """The total of named reward components: their sum, or their weighted sum.

    A component without a weight counts with weight 1.0. A weight naming no component raises,
    since a misspelt name would otherwise change nothing, silently.

    Raises:
        RewardError: a component is not a finite number.
        ConfigError: a weight names no component, or is not a finite number.
    """
    weights = weights or {}
    if unknown := sorted(set(weights) - set(components)):
        raise ConfigError(
            f"reward weights name unknown component(s) {unknown}; "
            f"the reward returned {sorted(components)}"
        )
    total = 0.0
    for name, value in components.items():
        if not _is_finite(value):
            raise RewardError(f"reward component {name!r} is {value!r}, not a finite number")
        weight = weights.get(name, 1.0)
        if not _is_finite(weight):
            raise ConfigError(f"reward weight {name!r} is {weight!r}, not a finite number")
        total += float(weight) * float(value)
    return total


def reward_total(value: RewardValue, weights: Mapping[str, float] | None = None) -> float:
    """The scalar a reward function's result stands for: a float as is, a dict `combine`d."""
    if isinstance(value, Mapping):
        return combine(value, weights)
    if weights:
        raise ConfigError("reward weights were given, but the reward returned a single float")
    if not _is_finite(value):
        raise RewardError(f"reward is {value!r}, not a finite number or a dict of them")
    return float(value)


def _is_finite(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
