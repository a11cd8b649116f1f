"""The comparison reward: the submitted choice, by meaning ("left", "image 1", "the first one"
all mean "first"), plus a format component for a submit_answer call with a choice.

Components: `choice` semantic_match(choice, answer, SYNONYMS) (0 when the choice also names the
other image: hedging does not pay); `format` `format_weight` when a choice string was submitted.
"""

from __future__ import annotations

from areno.rewards import RewardError, SynonymTable, semantic_match
from areno.rollout.trajectory import Trajectory
from examples.vl.common import submission

SYNONYMS = SynonymTable(
    {
        "first": ["1", "left", "first image", "image 1", "first one", "1st"],
        "second": ["2", "right", "second image", "image 2", "second one", "2nd"],
    }
)


def reward(
    trajectory: Trajectory, private: dict, *, format_weight: float = 0.2
) -> dict[str, float]:
    answer = private.get("answer")
    if answer not in ("first", "second"):
        raise RewardError(
            f"comparison sample private 'answer' must be first/second, got {answer!r}"
        )
    scores = {"choice": 0.0, "format": 0.0}
    args = submission(trajectory)
    choice = None if args is None else args.get("choice")
    if not isinstance(choice, str) or not choice.strip():
        return scores
    scores["format"] = format_weight
    other = "second" if answer == "first" else "first"
    if semantic_match(choice, other, SYNONYMS) < 1.0:
        scores["choice"] = semantic_match(choice, answer, SYNONYMS)
    return scores
