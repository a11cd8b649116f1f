"""One GRPO step on a group of multi-turn episodes, through the trainer's own `Learner`
(DeepSpeed on CPU, a one-rank gloo group in this process, no Ray; the group's episodes share
trainer passes): the trajectory the reward
favours gains logprob on the sampled tokens of EVERY turn, the others lose it, and the sign
follows the advantage. Episodes: the tiny Gemma 4 of the AVE example, a tool that returns an
image and one that returns audio between the turns (tests/rollout/scripted.py)."""

from __future__ import annotations

import pytest
import torch

from areno.train import controller
from areno.train.batching import plan_step
from areno.train.config import GRPOConfig
from areno.train.policy import sequence_logprobs
from tests.rollout.scripted import Turn, make_setup, run_scripted

GROUP = 4


@pytest.fixture(scope="module")
def group(tiny_path, tmp_path_factory):
    """GROUP episodes of look (image back) -> hear (audio back) -> submit, sampled at T=1."""
    setup = make_setup(tiny_path("gemma4"), tmp_path_factory.mktemp("scene"))
    try:
        script = [Turn(("look",)), Turn(("hear",)), Turn(("submit",))]
        episodes = run_scripted(setup, script, num_episodes=GROUP, seed=21)
    finally:
        setup.shutdown()
    return setup.checkpoint, episodes


def learner(checkpoint, lr: float):
    from areno.train.learner import Learner

    config = GRPOConfig.from_dict(
        {
            "model_path": str(checkpoint),
            "grpo": {
                "group_size": GROUP,
                "prompts_per_step": 1,
                "loss": {"loss_agg": "token_mean"},
            },
            "optim": {"lr": lr},
        }
    )
    return Learner(config, str(checkpoint), 0, 1)


def turn_logprobs(model, episodes) -> list[list[float]]:
    """Each episode's mean logprob of each turn's sampled tokens under `model`."""
    model.eval()
    out = []
    with torch.no_grad():
        for traj, sampled in episodes:
            n = traj.num_prompt_tokens
            scored = sequence_logprobs(model, traj.inputs, "cpu", n)
            out.append(
                [
                    scored[t.start - n : t.start - n + len(t.token_ids)].mean().item()
                    for t in sampled
                ]
            )
    return out


def one_step(checkpoint, episodes, rewards: list[float], lr: float = 1e-4, learn: bool = True):
    """Advantages as the trainer computes them, one Learner.train_step; the turns' mean
    logprobs before (the rollout's) and after. `learn=False` is the trainer's step without
    any advantage (no optimizer step)."""
    trajectories = [traj for traj, _ in episodes]
    for traj, reward in zip(trajectories, rewards, strict=True):
        traj.reward = reward
    advantages = controller.advantages([trajectories], normalize_std=True)
    before = [[sum(t.logprobs) / len(t.token_ids) for t in sampled] for _, sampled in episodes]
    model = learner(checkpoint, lr)
    pairs = list(zip(trajectories, advantages.tolist(), strict=True))
    (share,) = plan_step(pairs, 1, 1, model.config.trainer.micro_batch_tokens)
    sums = model.train_step(share, learn)
    after = turn_logprobs(model.module, episodes)
    model.deepspeed.destroy()
    return advantages, before, after, sums


@pytest.mark.parametrize("favoured", [0, 2])
def test_the_favoured_episode_gains_logprob_on_every_turn(process_group, group, favoured):
    checkpoint, episodes = group
    assert all(traj.num_turns == 3 for traj, _ in episodes)
    rewards = [1.0 if i == favoured else 0.0 for i in range(GROUP)]
    advantages, before, after, sums = one_step(checkpoint, episodes, rewards)
    assert advantages[favoured] > 0 and all(
        advantages[i] < 0 for i in range(GROUP) if i != favoured
    )
    # the trainer saw the rollout's logprobs (one forward per episode, media included)
    assert sums["max_abs"] < 1e-4 and sums["tokens"] == sum(
        t.num_generated_tokens for t, _ in episodes
    )
    for i in range(GROUP):
        deltas = [a - b for a, b in zip(after[i], before[i], strict=True)]
        if i == favoured:
            assert all(d > 0 for d in deltas), deltas  # every turn, tool results in between
        else:
            assert sum(deltas) < 0, (i, deltas)


def test_the_disfavoured_episode_loses_logprob_on_every_turn(process_group, group):
    checkpoint, episodes = group
    rewards = [0.0] + [1.0] * (GROUP - 1)
    advantages, before, after, _ = one_step(checkpoint, episodes, rewards)
    import deepspeed.comm.comm as ds_comm

    assert ds_comm.cdb.shm_comm_op is None  # gloo: DeepSpeed JIT-compiled no C++ op on CPU
    assert advantages[0] < 0
    deltas = [a - b for a, b in zip(after[0], before[0], strict=True)]
    assert all(d < 0 for d in deltas), deltas


@pytest.mark.parametrize("learn", [True, False])
def test_a_group_of_equal_rewards_leaves_the_policy_as_it_was(process_group, group, learn):
    """Zero advantages give no gradient; the trainer also skips the optimizer step then
    (learn=False), since a later step's Adam momentum would move the weights anyway."""
    checkpoint, episodes = group
    advantages, before, after, sums = one_step(checkpoint, episodes, [0.5] * GROUP, learn=learn)
    assert torch.equal(advantages, torch.zeros(GROUP)) and sums["loss"] == 0.0
    assert sums["tokens"] == (sum(t.num_generated_tokens for t, _ in episodes) if learn else 0)
    for b, a in zip(before, after, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
