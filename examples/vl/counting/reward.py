"""The counting reward: the submitted count against the true one.

Components: `count` 1.0 for the exact count (number words match too: "three" = 3, by
semantic_match with the number-word synonym table), `close_weight` when it is off by one;
`format` `format_weight` when the last submit_answer call carries a count at all.
"""

from __future__ import annotations

from areno.rewards import RewardError, SynonymTable, semantic_match
from areno.rollout.trajectory import Trajectory
from examples.vl.common import submission

NUMBERS = SynonymTable.default()


def _as_int(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float) and float(value).is_integer():
        return int(value)
    if isinstance(value, str):
        for n in range(21):
            if semantic_match(value, str(n), NUMBERS, max_extra_words=0) == 1.0:
                return n
    return None


def reward(
    trajectory: Trajectory, private: dict, *, close_weight: float = 0.25, format_weight: float = 0.2
) -> dict[str, float]:
    if not isinstance(private.get("count"), int):
        raise RewardError("counting sample private data lacks an integer 'count'")
    scores = {"count": 0.0, "format": 0.0}
    args = submission(trajectory)
    if args is None or "count" not in args:
        return scores
    scores["format"] = format_weight
    count = _as_int(args["count"])
    if count is not None:
        diff = abs(count - private["count"])
        scores["count"] = 1.0 if diff == 0 else close_weight if diff == 1 else 0.0
    return scores
