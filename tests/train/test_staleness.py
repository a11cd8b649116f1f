"""The overlapped loop's bound (`rollout.max_staleness`): each sampled token's policy version
is kept, counted per step by how far behind it is, and a token older than the bound stops the
run. The run itself (overlap on, the color quiz still learning) is in test_grpo_run.py."""

from __future__ import annotations

import pytest

from areno.engine.outputs import RequestOutput, SampleDelta, merge_outputs
from areno.processing.types import PromptInputs
from areno.rollout.trajectory import Trajectory
from areno.train.controller import staleness_metrics
from areno.train.learner import _sampled_by


def _traj(versions: list[int]) -> Trajectory:
    n = len(versions)
    inputs = PromptInputs(list(range(2 + n + 1)), {})
    mask = [0, 0] + [1] * n + [0]  # two prompt tokens, the reply, a closing tool token
    return Trajectory(
        "s", 0, inputs, 2, mask, [0.0] * len(mask), [max(versions)], token_versions=versions
    )


def test_a_merged_output_knows_the_version_of_each_token() -> None:
    steps = [
        RequestOutput("r", [SampleDelta(0, [5, 6])], policy_version=3),
        RequestOutput("r", [SampleDelta(0, [7])], policy_version=4, finished=True),
    ]
    assert merge_outputs(steps).samples[0].policy_versions == [3, 3, 4]


def test_staleness_is_counted_per_token_and_the_bound_is_enforced() -> None:
    trajectories = [_traj([4, 4, 5]), _traj([5])]
    metrics = staleness_metrics(trajectories, 5, max_staleness=1)
    assert metrics == {
        "staleness/0": 2.0,
        "staleness/1": 2.0,
        "staleness_max": 1.0,
        "partial_episodes": 1.0,  # the first: two policies sampled its tokens
    }
    with pytest.raises(RuntimeError, match="2 policy versions old; rollout.max_staleness is 1"):
        staleness_metrics([_traj([3, 5])], 5, max_staleness=1)


def test_the_engine_trainer_mismatch_is_read_on_the_trained_policys_tokens_only() -> None:
    traj = _traj([4, 4, 5])
    assert _sampled_by(traj, 5) == [0.0, 0.0, 1.0, 0.0]
    assert _sampled_by(traj, None) == [1.0, 1.0, 1.0, 1.0]
