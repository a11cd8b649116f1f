"""The off-policy correction and the ratio level as the trainer wires them (docs/architecture.md,
"Off-policy correction"): each accepted combination of `grpo.behaviour_logprobs` and
`grpo.loss.rollout_correction`, and GSPO's sequence-level ratio, does what it names, read from
the trainer's own metrics after one `Learner.train_step` on trajectories whose rollout logprobs
lie a known distance below the policy's (0.5 nats on every token, or 0 and 1 nat in turn); the
combinations whose correction would do nothing are refused."""

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
UNEVEN = (0.0, 1.0)  # the sampler's logprobs below the policy's, token by token in turn
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


def _episodes(path, shifts: tuple[float, ...]) -> list[Trajectory]:
    """Four text episodes, the rollout logprob of their t-th sampled token the policy's less
    shifts[t % len(shifts)]."""
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
        rollout = [0.0] * n + [lp - shifts[t % len(shifts)] for t, lp in enumerate(own)]
        out.append(
            Trajectory(
                f"g{i // 2}", i % 2, inputs, n, mask, rollout, [0], token_versions=[0] * (total - n)
            )
        )
    return out


@pytest.fixture(scope="module")
def trajectories(tiny_path):
    """Four text episodes, their rollout logprobs the policy's less SHIFT."""
    path = tiny_path(FAMILY)
    return path, _episodes(path, (SHIFT,))


@pytest.fixture(scope="module")
def uneven(tiny_path):
    """Four text episodes, their sampled tokens' rollout logprobs the policy's less 0 and 1
    nat in turn: each sequence's mean shift differs from its tokens'."""
    path = tiny_path(FAMILY)
    return path, _episodes(path, UNEVEN)


def _shifts(traj: Trajectory) -> list[float]:
    """The shift of each of `traj`'s sampled tokens."""
    return [UNEVEN[t % len(UNEVEN)] for t in range(traj.num_generated_tokens)]


def _token_weighted(trajs: list[Trajectory], per_sequence) -> float:
    """The token-weighted mean of `per_sequence(shifts)` over the trajectories."""
    total = sum(len(_shifts(t)) * per_sequence(_shifts(t)) for t in trajs)
    return total / sum(t.num_generated_tokens for t in trajs)


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
    assert metrics["tis_capped_fraction"] == 0.0 and metrics["masked_fraction"] == 0.0


@pytest.mark.parametrize("tis_cap", [2.0, 1.2])
def test_recompute_with_token_tis_weighs_each_token_by_proximal_over_sampler(
    process_group, trajectories, tis_cap
):
    path, trajs = trajectories
    loss = {"rollout_correction": "token_tis", "tis_cap": tis_cap}
    metrics = _train_metrics(path, trajs, behaviour_logprobs="recompute", loss=loss)
    # one optimizer step: the proximal policy is the one being trained, the ratio 1
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["tis_weight_mean"] == pytest.approx(min(math.exp(SHIFT), tis_cap), rel=1e-3)
    assert metrics["tis_capped_fraction"] == (1.0 if tis_cap < math.exp(SHIFT) else 0.0)


def test_sequence_tis_weighs_each_sequence_by_its_product_of_ratios(process_group, uneven):
    path, trajs = uneven
    loss = {"rollout_correction": "sequence_tis", "tis_cap": 1e6}
    metrics = _train_metrics(path, trajs, behaviour_logprobs="recompute", loss=loss)
    expected = _token_weighted(trajs, lambda shifts: math.exp(sum(shifts)))
    assert metrics["tis_weight_mean"] == pytest.approx(expected, rel=1e-3)
    assert metrics["tis_capped_fraction"] == 0.0
    # a cap of 2 truncates every sequence with a shift of 1 nat or more (e^1 > 2)
    loss["tis_cap"] = 2.0
    metrics = _train_metrics(path, trajs, behaviour_logprobs="recompute", loss=loss)
    capped = _token_weighted(trajs, lambda shifts: float(sum(shifts) >= 1.0))
    assert metrics["tis_capped_fraction"] == pytest.approx(capped, rel=1e-6) and capped > 0


def test_mask_drops_the_tokens_whose_proximal_over_sampler_leaves_the_band(process_group, uneven):
    """IcePop: tokens 1 nat off (proximal / sampler e = 2.72 > 2) are weighted 0; those the
    sampler agreed on train with weight 1."""
    path, trajs = uneven
    loss = {"rollout_correction": "mask", "mask_low": 0.5, "mask_high": 2.0}
    metrics = _train_metrics(path, trajs, behaviour_logprobs="recompute", loss=loss)
    off = _token_weighted(trajs, lambda shifts: sum(s > 0 for s in shifts) / len(shifts))
    assert 0 < off < 1
    assert metrics["masked_fraction"] == pytest.approx(off, abs=1e-6)
    assert metrics["tis_weight_mean"] == pytest.approx(1 - off, abs=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_ratio_level_takes_the_ratio_per_token_or_per_sequence(process_group, uneven, level):
    """Against the sampler's logprobs, 0 and 1 nat below the policy's in turn: token ratios of 1
    and e, or (GSPO) one ratio a sequence, exp(its mean shift), clipped within [1 - 3e-4,
    1 + 4e-4]: every token of a positive-advantage sequence clipped, none of a negative one's
    (there the unclipped side is the pessimistic one)."""
    path, trajs = uneven
    metrics = _train_metrics(path, trajs, behaviour_logprobs="rollout", loss={"ratio_level": level})
    if level == "token":
        expected = _token_weighted(trajs, lambda shifts: sum(map(math.exp, shifts)) / len(shifts))
        ratio_max = math.e
    else:
        expected = _token_weighted(trajs, lambda shifts: math.exp(sum(shifts) / len(shifts)))
        ratio_max = max(math.exp(sum(_shifts(t)) / len(_shifts(t))) for t in trajs)
        positive = [t for t, a in zip(trajs, ADVANTAGES, strict=True) if a > 0]
        clipped = sum(t.num_generated_tokens for t in positive)
        total = sum(t.num_generated_tokens for t in trajs)
        assert metrics["clip_fraction"] == pytest.approx(clipped / total, abs=1e-6)
    assert metrics["ratio_mean"] == pytest.approx(expected, rel=1e-3)
    assert metrics["ratio_max"] == pytest.approx(ratio_max, rel=1e-3)


def test_recompute_over_two_mini_batches_clips_against_the_policy_before_the_first(
    process_group, trajectories
):
    """The second optimizer step's ratio is to the proximal policy (before the first step),
    not 1: the first step moved the weights."""
    path, trajs = trajectories
    metrics = _train_metrics(
        path,
        trajs,
        behaviour_logprobs="recompute",
        mini_batches=2,
        loss={"rollout_correction": "token_tis", "tis_cap": 2.0},
    )
    assert metrics["optimizer_steps"] == 2
    assert metrics["ratio_max"] > 1.0 + 1e-4
    assert metrics["tis_weight_mean"] == pytest.approx(math.exp(SHIFT), rel=1e-3)


def test_combinations_whose_correction_would_do_nothing_are_refused(tiny_path):
    path = tiny_path(FAMILY)
    for correction in ("token_tis", "sequence_tis", "mask"):
        with pytest.raises(ConfigError, match=f"{correction} needs grpo.behaviour_logprobs: rec"):
            _config(path, behaviour_logprobs="rollout", loss={"rollout_correction": correction})
    stale = {"rollout": {"max_staleness": 1}}
    raw = _config(path, behaviour_logprobs="recompute").to_dict() | stale
    with pytest.raises(ConfigError, match="trained as if on-policy") as info:
        GRPOConfig.from_dict(raw)
    assert info.value.param == "rollout_correction"
    # accepted: recompute on-policy (staleness 0), and with a correction at any staleness
    for correction in ("token_tis", "sequence_tis", "mask"):
        raw["grpo"]["loss"]["rollout_correction"] = correction
        assert GRPOConfig.from_dict(raw).grpo.loss.rollout_correction == correction
    _config(path, behaviour_logprobs="recompute")
    # the cap alone, as configs set it before rollout_correction, names what to add
    with pytest.raises(ConfigError, match="Set rollout_correction: token_tis"):
        _config(path, behaviour_logprobs="recompute", loss={"tis_cap": 2.0})
