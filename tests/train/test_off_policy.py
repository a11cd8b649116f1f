"""The off-policy correction as the trainer wires it (docs/architecture.md, "Off-policy
correction"): each accepted combination of `grpo.behaviour_logprobs` and `grpo.loss.tis_cap`
does what it names, read from the trainer's own metrics after one `Learner.train_step` on
trajectories whose rollout logprobs lie a known 0.5 nats below the policy's; the combinations
whose correction would do nothing are refused."""

from __future__ import annotations

import math

import pytest
import torch

from areno.errors import ConfigError
from areno.processing.processor import Processor
from areno.rollout.trajectory import Trajectory
from areno.train.batching import plan_step
from areno.train.config import GRPOConfig
from areno.train.policy import sequence_logprobs

FAMILY = "qwen3_5"
SHIFT = 0.5  # the sampler's logprob of every sampled token, below the policy's
ADVANTAGES = [1.0, -1.0, 1.0, -1.0]


def _config(path, **grpo) -> GRPOConfig:
    loss = {"loss_agg": "token_mean", **grpo.pop("loss", {})}
    return GRPOConfig.from_dict(
        {
            "model_path": str(path),
            "grpo": {"group_size": 2, "prompts_per_step": 2, "loss": loss, **grpo},
            "trainer": {"zero_stage": 0, "micro_batch_tokens": 0},
            "optim": {"lr": 1e-3},
        }
    )


@pytest.fixture(scope="module")
def trajectories(tiny_path):
    """Four text episodes, their rollout logprobs the policy's less SHIFT."""
    path = tiny_path(FAMILY)
    processor = Processor(path)
    model = processor.adapter.load_model(path).eval()
    out = []
    for i, reply in enumerate(["It is red.", "Blue, I think.", "Green!", "It is a cat."]):
        messages = [
            {"role": "user", "content": "What color is the sky at noon?"},
            {"role": "assistant", "content": reply},
        ]
        prompt = processor.encode(messages[:1], [])
        inputs = processor.encode(messages, [])
        n, total = prompt.num_prompt_tokens, inputs.num_prompt_tokens
        with torch.no_grad():
            own = sequence_logprobs(model, inputs, "cpu", n).tolist()
        mask = [0] * n + [1] * (total - n)
        rollout = [0.0] * n + [lp - SHIFT for lp in own]
        out.append(
            Trajectory(
                f"g{i // 2}", i % 2, inputs, n, mask, rollout, [0], token_versions=[0] * (total - n)
            )
        )
    return path, out


def _train_metrics(path, trajs, **grpo) -> dict[str, float]:
    from areno.train.learner import Learner, reduce_sums

    torch.manual_seed(0)
    learner = Learner(_config(path, **grpo), str(path), 0, 1)
    try:
        pairs = list(zip(trajs, ADVANTAGES, strict=True))
        (share,) = plan_step(pairs, 1, learner.config.grpo.mini_batches, 0, version=0)
        return reduce_sums(learner.train_step(share))
    finally:
        learner.deepspeed.destroy()


def test_behaviour_rollout_takes_the_ratio_against_the_samplers_logprobs(
    process_group, trajectories
):
    path, trajs = trajectories
    metrics = _train_metrics(path, trajs, behaviour_logprobs="rollout")
    assert metrics["ratio_mean"] == pytest.approx(math.exp(SHIFT), rel=1e-3)
    assert metrics["clip_fraction"] > 0  # a ratio of 1.65 leaves the [0.8, 1.2] band
    assert metrics["tis_weight_mean"] == 1.0


@pytest.mark.parametrize("tis_cap", [2.0, 1.2])
def test_recompute_with_a_cap_weighs_each_token_by_proximal_over_sampler(
    process_group, trajectories, tis_cap
):
    path, trajs = trajectories
    metrics = _train_metrics(path, trajs, behaviour_logprobs="recompute", loss={"tis_cap": tis_cap})
    # one optimizer step: the proximal policy is the one being trained, the ratio 1
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["tis_weight_mean"] == pytest.approx(min(math.exp(SHIFT), tis_cap), rel=1e-3)


def test_recompute_over_two_mini_batches_clips_against_the_policy_before_the_first(
    process_group, trajectories
):
    """The second optimizer step's ratio is to the proximal policy (before the first step),
    not 1: the first step moved the weights."""
    path, trajs = trajectories
    metrics = _train_metrics(
        path, trajs, behaviour_logprobs="recompute", mini_batches=2, loss={"tis_cap": 2.0}
    )
    assert metrics["optimizer_steps"] == 2
    assert metrics["ratio_max"] > 1.0 + 1e-4
    assert metrics["tis_weight_mean"] == pytest.approx(math.exp(SHIFT), rel=1e-3)


def test_combinations_whose_correction_would_do_nothing_are_refused(tiny_path):
    path = tiny_path(FAMILY)
    with pytest.raises(ConfigError, match="tis_cap needs grpo.behaviour_logprobs: recompute"):
        _config(path, behaviour_logprobs="rollout", loss={"tis_cap": 2.0})
    stale = {"rollout": {"max_staleness": 1}}
    raw = _config(path, behaviour_logprobs="recompute").to_dict() | stale
    with pytest.raises(ConfigError, match="trained as if on-policy"):
        GRPOConfig.from_dict(raw)
    # accepted: recompute on-policy (staleness 0), and with a cap at any staleness
    raw["grpo"]["loss"]["tis_cap"] = 2.0
    assert GRPOConfig.from_dict(raw).grpo.loss.tis_cap == 2.0
    _config(path, behaviour_logprobs="recompute")
