"""A text task for tests/train/test_partial_rollouts.py. Unshuffled, one prompt a step: the
first sample's prompt nearly fills the context (its episodes end after a few tokens), the
others are short (their episodes sample up to `rollout.max_tokens_per_turn`), so the second
step's episodes are still running when the first step's weights land. The reward is the
episode's index in its group, so every group's rewards spread and every step trains (a reward
from the sampled tokens left a step untrained whenever a group's samples agreed), and each
scored trajectory is appended to the file `record` names, as the trainer receives it."""

from __future__ import annotations

import json
from collections.abc import Iterator

from areno.data import Sample
from areno.rollout.trajectory import Trajectory


def load(split: str = "train", num_samples: int = 8, long_words: int = 0) -> Iterator[Sample]:
    for index in range(num_samples):
        filler = " ".join(["red"] * long_words) + " " if index == 0 and long_words else ""
        messages = [{"role": "user", "content": f"{filler}Name a color (case {index})."}]
        yield Sample(messages, id=f"{split}-{index}")


def reward(trajectory: Trajectory, private: dict, record: str | None = None) -> float:
    if record is not None:
        with open(record, "a") as out:
            out.write(json.dumps(_record(trajectory)) + "\n")
    return float(trajectory.episode_index)


def _record(traj: Trajectory) -> dict:
    return {
        "sample_id": traj.sample_id,
        "episode_index": traj.episode_index,
        "token_ids": traj.token_ids,
        "num_prompt_tokens": traj.num_prompt_tokens,
        "loss_mask": traj.loss_mask,
        "rollout_logprobs": traj.rollout_logprobs,
        "token_versions": traj.token_versions,
    }
