"""GRPO loss math against numbers worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from areno.errors import ConfigError
from areno.train.grpo import (
    LOSS_AGGS,
    METRIC_SUMS,
    RATIO_LEVELS,
    ROLLOUT_CORRECTIONS,
    GRPOLossConfig,
    group_advantages,
    policy_loss,
    policy_loss_terms,
    token_logprobs,
)

LN2 = math.log(2.0)


def approx(values, *, abs: float = 1e-5):
    return pytest.approx(values, abs=abs)


def ratios_to_logprobs(ratios: list[list[float]], old: float = -1.0) -> tuple[torch.Tensor, ...]:
    """(logprobs, old_logprobs) such that exp(logprobs - old_logprobs) == ratios."""
    old_logprobs = torch.full((len(ratios), len(ratios[0])), old)
    logprobs = (old_logprobs + torch.tensor(ratios).log()).requires_grad_(True)
    return logprobs, old_logprobs


# Row 0 has A = +1, row 1 has A = -2; clip range [0.8, 1.2].
#   r=1.0, A=+1: min(1.0, 1.0)   =  1.0  -> loss -1.0
#   r=1.5, A=+1: min(1.5, 1.2)   =  1.2  -> loss -1.2  (clipped)
#   r=0.5, A=+1: min(0.5, 0.8)   =  0.5  -> loss -0.5  (unclipped: pessimistic side)
#   r=1.1, A=-2: min(-2.2, -2.2) = -2.2  -> loss  2.2
#   r=0.5, A=-2: min(-1.0, -1.6) = -1.6  -> loss  1.6  (clipped)
#   r=1.5, A=-2: min(-3.0, -2.4) = -3.0  -> loss  3.0  (unclipped: pessimistic side)
RATIOS = [[1.0, 1.5, 0.5], [1.1, 0.5, 1.5]]
ADVANTAGES = torch.tensor([1.0, -2.0])


# ---------------------------------------------------------------- advantages


def test_advantages_normalised_non_contiguous_groups_and_singleton() -> None:
    rewards = torch.tensor([1.0, 3.0, 0.0, 5.0, 2.0])
    # group 7 = {1, 0}: mean 0.5, std 0.5 -> +1, -1
    # group 4 = {3, 2}: mean 2.5, std 0.5 -> +1, -1
    # group 9 = {5}: a singleton -> 0
    adv = group_advantages(rewards, [7, 4, 7, 9, 4])
    assert adv.dtype == torch.float32
    assert adv.tolist() == approx([1.0, 1.0, -1.0, 0.0, -1.0])
    same = group_advantages(rewards, torch.tensor([7, 4, 7, 9, 4]))
    assert same.tolist() == adv.tolist()


def test_advantages_without_std() -> None:
    rewards = torch.tensor([1.0, 3.0, 0.0, 5.0, 2.0])
    # reward minus group mean: 1-0.5, 3-2.5, 0-0.5, 5-5, 2-2.5
    adv = group_advantages(rewards, [7, 4, 7, 9, 4], normalize_std=False)
    assert adv.tolist() == approx([0.5, 0.5, -0.5, 0.0, -0.5])


def test_advantages_population_std_of_three() -> None:
    # {0, 1, 2}: mean 1, variance (1 + 0 + 1) / 3 = 2/3, std 0.816497 -> -1.224745, 0, 1.224745
    adv = group_advantages(torch.tensor([0.0, 1.0, 2.0]), [0, 0, 0])
    assert adv.tolist() == approx([-1.224745, 0.0, 1.224745])


def test_advantages_equal_rewards_are_zero_not_nan() -> None:
    adv = group_advantages(torch.tensor([1.0, 1.0, 0.3, 0.3]), [0, 0, 1, 1])
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_advantages_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="same length"):
        group_advantages(torch.tensor([1.0, 2.0]), [0, 0, 1])


# ---------------------------------------------------------------- token log-probs


def test_token_logprobs_by_hand() -> None:
    # logits (0, 0, ln 2): softmax denominator 1 + 1 + 2 = 4
    #   token 2: ln(2/4) = -0.693147; token 0: ln(1/4) = -1.386294
    logits = torch.tensor([[[0.0, 0.0, LN2], [0.0, 0.0, LN2]]])
    out = token_logprobs(logits, torch.tensor([[2, 0]]))
    assert out.shape == (1, 2)
    assert out.tolist() == [approx([-LN2, -2 * LN2])]


def test_token_logprobs_bf16_is_float32_and_matches_log_softmax() -> None:
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0)).bfloat16()
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    out = token_logprobs(logits, ids)
    assert out.dtype == torch.float32
    expected = logits.float().log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------- policy loss


def test_clipped_loss_by_hand() -> None:
    logprobs, old = ratios_to_logprobs(RATIOS)
    loss, metrics = policy_loss(
        logprobs, old, ADVANTAGES, torch.ones(2, 3), config=GRPOLossConfig()
    )
    # (-1 - 1.2 - 0.5 + 2.2 + 1.6 + 3.0) / 6 = 4.1 / 6
    assert loss.item() == approx(4.1 / 6)
    assert metrics["clip_fraction"] == approx(2 / 6)
    # (1 + 1.5 + 0.5 + 1.1 + 0.5 + 1.5) / 6 = 6.1 / 6
    assert metrics["ratio_mean"] == approx(6.1 / 6)
    assert metrics["ratio_max"] == approx(1.5)
    assert "kl" not in metrics and "tis_weight_mean" not in metrics
    loss.backward()
    # d(-r A)/d logp = -r A on unclipped tokens, 0 on clipped ones; all over 6 tokens
    assert logprobs.grad.tolist() == [
        approx([-1.0 / 6, 0.0, -0.5 / 6]),
        approx([2.2 / 6, 0.0, 3.0 / 6]),
    ]


def test_clip_higher_and_clip_fraction_direction() -> None:
    # A=+1, range [0.8, 1.28]: r=1.25 inside; r=1.3 clipped to 1.28; r=0.75 below the range,
    # but for A>0 the min picks the unclipped 0.75, so it does not count as clipped.
    logprobs, old = ratios_to_logprobs([[1.25, 1.3, 0.75]])
    loss, metrics = policy_loss(
        logprobs, old, torch.tensor([1.0]), torch.ones(1, 3), config=GRPOLossConfig(clip_high=0.28)
    )
    # -(1.25 + 1.28 + 0.75) / 3 = -3.28 / 3
    assert loss.item() == approx(-3.28 / 3)
    assert metrics["clip_fraction"] == approx(1 / 3)


def test_masked_tokens_do_not_count() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    logprobs, old = ratios_to_logprobs(RATIOS)
    loss, metrics = policy_loss(logprobs, old, ADVANTAGES, mask, config=GRPOLossConfig())
    # valid: -1, -1.2, 2.2, 3.0 -> 3.0 / 4; clipped: only the r=1.5, A=+1 token
    assert loss.item() == approx(0.75)
    assert metrics["clip_fraction"] == approx(0.25)
    # ratio mean over 1, 1.5, 1.1, 1.5 = 5.1 / 4
    assert metrics["ratio_mean"] == approx(5.1 / 4)
    loss.backward()

    wild = logprobs.detach().clone()
    wild[0, 2] = 50.0
    wild[1, 1] = float("-inf")
    wild.requires_grad_(True)
    loss2, metrics2 = policy_loss(wild, old, ADVANTAGES, mask, config=GRPOLossConfig())
    loss2.backward()
    assert loss2.item() == loss.item()
    assert metrics2 == metrics
    assert wild.grad.tolist() == logprobs.grad.tolist()
    assert wild.grad[0, 2] == 0.0 and wild.grad[1, 1] == 0.0


@pytest.mark.parametrize(
    ("loss_agg", "expected"),
    [
        # valid losses: row 0 -> -1, -1.2, -0.5 (sum -2.7); row 1 -> 2.2 (sum 2.2)
        ("token_mean", (-2.7 + 2.2) / 4),  # -0.125
        ("seq_mean_token_mean", (-2.7 / 3 + 2.2 / 1) / 2),  # (-0.9 + 2.2) / 2 = 0.65
        ("seq_mean_token_sum_norm", (-2.7 / 4 + 2.2 / 4) / 2),  # max_response_len 4: -0.0625
    ],
)
def test_loss_aggregation_modes(loss_agg: str, expected: float) -> None:
    config = GRPOLossConfig(loss_agg=loss_agg, max_response_len=4)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    logprobs, old = ratios_to_logprobs(RATIOS)
    loss, _ = policy_loss(logprobs, old, ADVANTAGES, mask, config=config)
    assert loss.item() == approx(expected)


def test_seq_mean_skips_sequences_without_valid_tokens() -> None:
    config = GRPOLossConfig(loss_agg="seq_mean_token_mean")
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    logprobs, old = ratios_to_logprobs(RATIOS)
    loss, _ = policy_loss(logprobs, old, ADVANTAGES, mask, config=config)
    assert loss.item() == approx(-0.9)  # row 0's mean alone


def test_k3_kl_term() -> None:
    # A = 0, so only the KL term is left. delta = ref - logp; k3 = e^delta - delta - 1:
    #   delta 0 -> 0; delta ln2 -> 2 - ln2 - 1 = 0.306853; delta -ln2 -> 0.5 + ln2 - 1 = 0.193147
    #   sum = 0.5, mean = 0.5 / 3; loss = 0.1 * 0.5 / 3
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0 + LN2, -1.0 - LN2]])
    loss, metrics = policy_loss(
        logprobs,
        logprobs.detach(),
        torch.zeros(1),
        torch.ones(1, 3),
        config=GRPOLossConfig(kl_coef=0.1),
        ref_logprobs=ref,
    )
    assert metrics["kl"] == approx(0.5 / 3)
    assert loss.item() == approx(0.1 * 0.5 / 3)
    loss.backward()
    # d k3 / d logp = 1 - e^delta: 0, 1 - 2 = -1, 1 - 0.5 = 0.5; times 0.1 / 3
    assert logprobs.grad.tolist() == [approx([0.0, -0.1 / 3, 0.05 / 3])]


def test_kl_metric_without_kl_loss() -> None:
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.0, -1.0 + LN2, -1.0 - LN2]])
    config = GRPOLossConfig()
    loss, metrics = policy_loss(
        logprobs, logprobs, torch.zeros(1), torch.ones(1, 3), config=config, ref_logprobs=ref
    )
    assert loss.item() == 0.0
    assert metrics["kl"] == approx(0.5 / 3)


def test_tis_weight_and_cap() -> None:
    # r = 1, A = +1, so each token's loss is -w. old - rollout = 0, ln 0.5, ln 4
    #   -> raw weights 1, 0.5, 4 -> capped at 2: 1, 0.5, 2; loss -(3.5) / 3
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    logprobs = old.clone().requires_grad_(True)
    rollout = (old - torch.tensor([[0.0, math.log(0.5), math.log(4.0)]])).requires_grad_(True)
    loss, metrics = policy_loss(
        logprobs,
        old,
        torch.tensor([1.0]),
        torch.ones(1, 3),
        config=GRPOLossConfig(rollout_correction="token_tis", tis_cap=2.0),
        rollout_logprobs=rollout,
    )
    assert loss.item() == approx(-3.5 / 3)
    assert metrics["tis_weight_mean"] == approx(3.5 / 3)
    assert metrics["tis_capped_fraction"] == approx(1 / 3) and metrics["masked_fraction"] == 0
    loss.backward()
    assert logprobs.grad.tolist() == [approx([-1 / 3, -0.5 / 3, -2 / 3])]
    assert rollout.grad is None  # the weight is a constant


def test_missing_inputs_are_errors() -> None:
    logprobs, old = ratios_to_logprobs(RATIOS)
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        config = GRPOLossConfig(rollout_correction="mask")
        policy_loss(logprobs, old, ADVANTAGES, mask, config=config)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, old, ADVANTAGES, mask, config=GRPOLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logprobs, old, torch.ones(2, 3), mask, config=GRPOLossConfig())
    with pytest.raises(ValueError, match="loss_mask"):
        policy_loss(logprobs, old, ADVANTAGES, torch.ones(2, 4), config=GRPOLossConfig())


def test_old_tis_cap_alone_names_the_setting_to_add() -> None:
    with pytest.raises(ConfigError, match="rollout_correction: token_tis"):
        GRPOLossConfig(tis_cap=2.0)


def test_sequence_tis_weighs_every_token_by_its_sequences_capped_product() -> None:
    # r = 1, A = +1: each token's loss is -w. Row 0's proximal / sampler ratios 2, 0.5, 1.5
    # -> product 1.5 (under the cap 2); row 1's 2, 2 -> product 4, capped at 2.
    # losses: row 0: -1.5 x 3; row 1: -2 x 2 -> token mean -(4.5 + 4) / 5
    old = torch.full((2, 3), -1.0)
    log_w = torch.tensor([[LN2, -LN2, math.log(1.5)], [LN2, LN2, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    logprobs = old.clone().requires_grad_(True)
    config = GRPOLossConfig(rollout_correction="sequence_tis", tis_cap=2.0)
    loss, metrics = policy_loss(
        logprobs, old, torch.ones(2), mask, config=config, rollout_logprobs=old - log_w
    )
    assert loss.item() == approx(-8.5 / 5)
    assert metrics["tis_weight_mean"] == approx(8.5 / 5)
    assert metrics["tis_capped_fraction"] == approx(2 / 5)  # row 1's two tokens
    loss.backward()
    assert logprobs.grad.tolist() == [approx([-0.3] * 3), approx([-0.4, -0.4, 0.0])]


def test_mask_weighs_tokens_outside_the_band_zero_and_keeps_them_in_the_normaliser() -> None:
    # proximal / sampler: 1, 4 (above 2), 0.25 (below 0.5), 2 (the band's edge: kept)
    old = torch.full((1, 4), -1.0)
    log_w = torch.tensor([[0.0, 2 * LN2, -2 * LN2, LN2]])
    logprobs = old.clone().requires_grad_(True)
    config = GRPOLossConfig(rollout_correction="mask", mask_low=0.5, mask_high=2.0)
    loss, metrics = policy_loss(
        logprobs, old, torch.ones(1), torch.ones(1, 4), config=config, rollout_logprobs=old - log_w
    )
    assert loss.item() == approx(-2 / 4)  # two tokens of -1, over all four
    assert metrics["masked_fraction"] == approx(0.5)
    assert metrics["tis_weight_mean"] == approx(0.5) and metrics["tis_capped_fraction"] == 0
    loss.backward()
    assert logprobs.grad.tolist() == [approx([-0.25, 0.0, 0.0, -0.25])]


def test_gspo_takes_one_ratio_per_sequence_and_each_tokens_gradient() -> None:
    # Row 0 (A = +1): token ratios 2, 0.5, 1 -> log s = (ln2 - ln2 + 0) / 3 = 0 -> s = 1;
    # row 1 (A = -1): token ratios 1.2, 1.2 -> s = 1.2, above 1 + 4e-4: clipped for A < 0.
    # Loss per token: row 0 -1 (x3); row 1 min(-1.2, -1.0004) -> +1.2 (the unclipped side is
    # the pessimistic one for A < 0: clipping takes effect only on r < 1 - 3e-4).
    ratios = [[2.0, 0.5, 1.0], [1.2, 1.2, 1.0]]
    logprobs, old = ratios_to_logprobs(ratios)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    config = GRPOLossConfig(ratio_level="sequence", loss_agg="seq_mean_token_mean")
    assert config.clip_range == (3e-4, 4e-4)
    loss, metrics = policy_loss(logprobs, old, torch.tensor([1.0, -1.0]), mask, config=config)
    assert loss.item() == approx((-1.0 + 1.2) / 2)
    # every token carries its sequence's ratio: (1 + 1 + 1 + 1.2 + 1.2) / 5
    assert metrics["ratio_mean"] == approx(5.4 / 5) and metrics["ratio_max"] == approx(1.2)
    assert metrics["clip_fraction"] == 0.0
    loss.backward()
    # d/d logp_t of -A s over the sequence's mean: -A s / |y| per token (not -A r_t / |y|)
    assert logprobs.grad.tolist() == [
        approx([-1 / 3 / 2] * 3),
        approx([1.2 / 2 / 2, 1.2 / 2 / 2, 0.0]),
    ]


def test_gspo_clips_a_whole_sequence_with_its_own_range() -> None:
    # A = +1 and s = 1.2 > 1 + 4e-4: every token of the sequence is clipped, no gradient; a
    # token-level ratio of the same tokens would sit inside PPO's [0.8, 1.2] band.
    logprobs, old = ratios_to_logprobs([[1.1, 1.3]])
    config = GRPOLossConfig(ratio_level="sequence")
    loss, metrics = policy_loss(logprobs, old, torch.ones(1), torch.ones(1, 2), config=config)
    s = math.sqrt(1.1 * 1.3)
    assert loss.item() == approx(-(1 + 4e-4)) and s > 1 + 4e-4
    assert metrics["clip_fraction"] == 1.0 and metrics["ratio_mean"] == approx(s)
    loss.backward()
    assert logprobs.grad.tolist() == [[0.0, 0.0]]
    # set ranges win over the level's defaults
    wide = GRPOLossConfig(ratio_level="sequence", clip_low=0.2, clip_high=0.28)
    assert wide.clip_range == (0.2, 0.28) and GRPOLossConfig().clip_range == (0.2, 0.2)


@pytest.mark.parametrize(("advantage", "direction"), [(1.0, 1.0), (-1.0, -1.0)])
def test_sgd_step_follows_advantage_sign(advantage: float, direction: float) -> None:
    logits = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    ids = torch.tensor([[0, 3, 5, 2]])
    before = token_logprobs(logits, ids).detach()
    loss, _ = policy_loss(
        token_logprobs(logits, ids),
        before,
        torch.tensor([advantage]),
        torch.ones(1, 4),
        config=GRPOLossConfig(),
    )
    loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    after = token_logprobs(logits, ids)
    assert bool(((after - before) * direction > 0).all())


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": float("nan")}, "clip_high"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"tis_cap": 0.0, "rollout_correction": "token_tis"}, "tis_cap"),
        ({"tis_cap": 2.0}, "tis_cap"),  # a cap of no correction: rollout_correction is off
        ({"tis_cap": 2.0, "rollout_correction": "mask"}, "tis_cap"),
        ({"mask_high": 2.0, "rollout_correction": "token_tis"}, "mask_high"),
        ({"mask_low": 2.0, "mask_high": 1.5, "rollout_correction": "mask"}, "mask_low"),
        ({"rollout_correction": "tis"}, "rollout_correction"),
        ({"ratio_level": "episode"}, "ratio_level"),
        ({"loss_agg": "seq_sum"}, "loss_agg"),
        ({"loss_agg": "seq_mean_token_sum_norm"}, "max_response_len"),
        ({"max_response_len": 0}, "max_response_len"),
        ({"max_response_len": True}, "max_response_len"),
    ],
)
def test_config_validation(kwargs: dict, param: str) -> None:
    with pytest.raises(ConfigError) as info:
        GRPOLossConfig(**kwargs)
    assert info.value.param == param


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("correction", ROLLOUT_CORRECTIONS)
def test_a_padded_batch_scores_each_sequence_as_it_alone(loss_agg, ratio_level, correction) -> None:
    """The learner scores a micro-batch's trajectories as one right-padded batch
    (`policy_loss_terms`): each sequence's loss (`LossTerms.sequence_losses`) and gradient are
    `policy_loss`'s of that sequence alone, and the metric sums are its metrics times its valid
    tokens, summed. Sequences of 3, 1 and 4 tokens, one with no valid token."""
    torch.manual_seed(0)
    lengths, masks = [3, 1, 4], [[1, 0, 1], [0], [1, 1, 0, 1]]
    extra = {"max_response_len": 8} if loss_agg == "seq_mean_token_sum_norm" else {}
    config = GRPOLossConfig(
        loss_agg=loss_agg,
        ratio_level=ratio_level,
        rollout_correction=correction,
        kl_coef=0.1,
        **extra,
    )
    rows = [(torch.randn(n) * 0.3 - 1.0).requires_grad_(True) for n in lengths]
    old = [r.detach() + torch.randn(len(r)) * 0.2 for r in rows]
    sampler = [o + torch.randn(len(o)) * 0.2 for o in old]
    ref = [r.detach() + torch.randn(len(r)) * 0.1 for r in rows]
    adv = torch.tensor([1.0, -0.5, -2.0])

    def pad(tensors):
        return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True)

    mask = pad([torch.tensor(m, dtype=torch.float32) for m in masks])
    terms = policy_loss_terms(
        pad(rows), pad(old), adv, mask,
        config=config, ref_logprobs=pad(ref), rollout_logprobs=pad(sampler),
    )  # fmt: skip
    batched = terms.sequence_losses(config)
    batched.sum().backward()
    together = [r.grad.clone() for r in rows]
    sums = {key: 0.0 for key in METRIC_SUMS.values()}
    for b, row in enumerate(rows):
        row.grad = None
        alone, metrics = policy_loss(
            row[None], old[b][None], adv[b : b + 1], mask[b : b + 1, : lengths[b]],
            config=config, ref_logprobs=ref[b][None], rollout_logprobs=sampler[b][None],
        )  # fmt: skip
        alone.backward()
        assert float(batched[b].detach()) == approx(float(alone.detach()))
        assert together[b].tolist() == approx(row.grad.tolist())
        for name, key in METRIC_SUMS.items():
            sums[key] += metrics.get(name, 0.0) * sum(masks[b])
    for key, value in terms.sums.items():
        assert float(value) == approx(sums[key]), key
    assert set(terms.sums) == {"clip", "ratio", "kl"} | (
        set() if correction == "off" else {"tis", "capped", "masked"}
    )
