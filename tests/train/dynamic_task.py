"""A text task for tests/train/test_recipes.py: the samples listed in `flat` score one constant
reward whatever the policy answers (a group of them has no advantage: dynamic sampling drops
it); the others score the first sampled token's id modulo 7, which the groups' samples of a
random tiny model rarely all share."""

from __future__ import annotations

from collections.abc import Iterator

from areno.data import Sample
from areno.rollout.trajectory import Trajectory

FLAT_REWARD = 0.75


def load(split: str = "train", num_samples: int = 16, flat: list[int] = ()) -> Iterator[Sample]:
    for index in range(num_samples):
        kind = "flat" if index in flat else "live"
        messages = [{"role": "user", "content": f"Name a color, any color (case {index})."}]
        private = {"constant": FLAT_REWARD} if kind == "flat" else {}
        yield Sample(messages, private=private, id=f"{split}-{kind}-{index}")


def reward(trajectory: Trajectory, private: dict) -> float:
    if "constant" in private:
        return private["constant"]
    return (trajectory.token_ids[trajectory.num_prompt_tokens] % 7) / 6
