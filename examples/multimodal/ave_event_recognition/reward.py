"""The AVE reward: the submitted label (semantic match with synonyms), the segment's overlap with
the event (temporal IoU, partial credit), and the format of the submit_answer call.

Components (their sum is the reward):
- `label`: semantic_match(label, the event's name, SYNONYMS), in [0, 1];
- `segment`: `segment_weight` x IoU of [start_s, end_s] with the event's segment;
- `format`: `format_weight` when the episode's last submit_answer call has a string label and two
  numbers with start <= end, else 0.

Only the last submit_answer call counts; an episode without one scores 0 on every component.
"""

from __future__ import annotations

import json
import math
from numbers import Real

from areno.rewards import RewardError, segment_iou, semantic_match
from areno.rollout.trajectory import Trajectory
from examples.multimodal.ave_event_recognition.events import SYNONYMS

FINAL_TOOL = "submit_answer"


def submission(trajectory: Trajectory, tool: str = FINAL_TOOL) -> dict | None:
    """The arguments of the last `tool` call when they parse as a JSON object, else None."""
    calls = [call for call in trajectory.tool_calls if call.name == tool]
    if not calls:
        return None
    try:
        arguments = json.loads(calls[-1].arguments or "{}")
    except json.JSONDecodeError:
        return None
    return arguments if isinstance(arguments, dict) else None


def _seconds(value) -> float | None:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        return None
    return float(value)


def reward(
    trajectory: Trajectory,
    private: dict,
    *,
    segment_weight: float = 0.5,
    format_weight: float = 0.2,
) -> dict[str, float]:
    try:
        ref_label, ref_segment = private["label"], (private["start_s"], private["end_s"])
    except KeyError as error:
        raise RewardError(
            f"AVE sample private data lacks {error}; regenerate the dataset"
        ) from None
    scores = {"label": 0.0, "segment": 0.0, "format": 0.0}
    args = submission(trajectory)
    if args is None:
        return scores
    label = args.get("label")
    start, end = _seconds(args.get("start_s")), _seconds(args.get("end_s"))
    if isinstance(label, str) and label.strip():
        scores["label"] = semantic_match(label, ref_label, SYNONYMS)
    if start is not None and end is not None and start <= end:
        scores["segment"] = segment_weight * segment_iou((start, end), ref_segment)
        if isinstance(label, str) and label.strip():
            scores["format"] = format_weight
    return scores
