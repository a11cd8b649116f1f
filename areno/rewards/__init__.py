"""Reward functions for GRPO training, and the building blocks they are made of.

The contract: a reward function is `reward(trajectory, private: dict) -> float | dict[str, float]`.

- `trajectory` is the rollout to score (the messages the model produced, with any tool calls).
- `private` is `Sample.private`: the reference answers and anything else only the reward may read.
  It never reaches the policy, the tool environments or the logs.
- A float is the reward. A dict is named components (`{"answer": 1.0, "format": 0.5}`); its total
  is their sum, unless the caller weights them: `combine(components, weights)`. Components are
  logged by name, so a reward should return the same names on every call.
- It is deterministic and raises `RewardError` for input it cannot score (a data bug), rather than
  returning 0.0 silently; a malformed model output is not a data bug and scores low instead.

Building blocks: `exact_match`, `normalized_match` and `normalize_text` (`match`);
`semantic_match` and `SynonymTable` (`semantic`); `extract_answer`, `format_reward` and
`segment_iou` (`format`).
"""

from __future__ import annotations

from areno.rewards.base import RewardError, RewardFn, RewardValue, combine, reward_total
from areno.rewards.format import extract_answer, format_reward, segment_iou
from areno.rewards.match import exact_match, normalize_text, normalized_match
from areno.rewards.semantic import SynonymTable, semantic_match, stem

__all__ = [
    "RewardError",
    "RewardFn",
    "RewardValue",
    "SynonymTable",
    "combine",
    "exact_match",
    "extract_answer",
    "format_reward",
    "normalize_text",
    "normalized_match",
    "reward_total",
    "segment_iou",
    "semantic_match",
    "stem",
]
