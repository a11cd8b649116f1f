"""GRPO loss math: group-relative advantages, token log-probs, the clipped policy loss.

Pure tensor functions, no model, Ray or DeepSpeed code. Shapes: B sequences, T response
tokens, V vocabulary entries. Every [B, T] tensor is aligned with `loss_mask`, which is 1 on
the tokens the policy produced and 0 on prompt, padding and tool-output tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from areno.errors import ConfigError
from areno.settings import setting

LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
RATIO_LEVELS = ("token", "sequence")
ROLLOUT_CORRECTIONS = ("off", "token_tis", "sequence_tis", "mask")
# The clip range where clip_low / clip_high are not set, by ratio level: PPO's, and GSPO's
# (a sequence's ratio is a mean of log-ratios, far closer to 1 than a token's).
DEFAULT_CLIP = {"token": (0.2, 0.2), "sequence": (3e-4, 4e-4)}
DEFAULT_TIS_CAP = 2.0
DEFAULT_MASK_BAND = (0.5, 5.0)  # IcePop's


@dataclass(frozen=True)
class GRPOLossConfig:
    """How `policy_loss` weighs and aggregates per-token losses."""

    ratio_level: str = setting(
        "token",
        choices=RATIO_LEVELS,
        help="token: each token's ratio pi / pi_old is clipped (PPO); sequence: GSPO, every "
        "token of a sequence takes the sequence's ratio exp(mean of its tokens' log-ratios), "
        "clipped as one, the gradient flowing through each token's own logprob",
    )
    clip_low: float | None = setting(
        None,
        help="the ratio is clipped below at 1 - clip_low; none: 0.2 at the token level, 3e-4 "
        "at the sequence level (GSPO's)",
    )
    clip_high: float | None = setting(
        None,
        help="the ratio is clipped above at 1 + clip_high (above clip_low: DAPO's "
        "clip-higher); none: 0.2 at the token level, 4e-4 at the sequence level (GSPO's)",
    )
    kl_coef: float = setting(
        0.0, help="weight of the k3 KL estimate to a frozen reference policy; 0: off"
    )
    rollout_correction: str = setting(
        "off",
        choices=ROLLOUT_CORRECTIONS,
        help="how each token's loss is corrected for the sampler / proximal policy mismatch "
        "(needs grpo.behaviour_logprobs: recompute): token_tis weighs it by min(proximal / "
        "sampler, tis_cap) (decoupled PPO); sequence_tis by min(the product of those ratios "
        "over its sequence, tis_cap); mask weighs it 0 where proximal / sampler leaves "
        "[mask_low, mask_high] (IcePop); the accepted combinations are in "
        'docs/architecture.md, "Off-policy correction"',
    )
    tis_cap: float | None = setting(
        None,
        help="the cap of the truncated importance weight (rollout_correction: token_tis or "
        "sequence_tis); none: 2.0",
    )
    mask_low: float | None = setting(
        None,
        help="rollout_correction: mask keeps tokens whose proximal / sampler ratio is at "
        "least this; none: 0.5",
    )
    mask_high: float | None = setting(
        None,
        help="rollout_correction: mask keeps tokens whose proximal / sampler ratio is at "
        "most this; none: 5.0",
    )
    loss_agg: str = setting(
        "token_mean",
        choices=LOSS_AGGS,
        help="token_mean: the batch's valid tokens' mean (DAPO); seq_mean_token_mean: each "
        "sequence's token mean, then the mean over sequences (GSPO's); "
        "seq_mean_token_sum_norm: each sequence's token sum / max_response_len, then the mean "
        "(Dr.GRPO)",
    )
    max_response_len: int | None = setting(
        None, help="the constant normaliser of seq_mean_token_sum_norm"
    )

    def __post_init__(self) -> None:
        _check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        _check_choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        if self.clip_low is not None:
            _check_number("clip_low", self.clip_low, low=0.0, high=1.0, high_open=True)
        if self.clip_high is not None:
            _check_number("clip_high", self.clip_high, low=0.0)
        _check_number("kl_coef", self.kl_coef, low=0.0)
        if self.tis_cap is not None:
            _check_number("tis_cap", self.tis_cap, low=0.0, low_open=True)
            if self.rollout_correction not in ("token_tis", "sequence_tis"):
                raise ConfigError(
                    f"tis_cap caps the weight of rollout_correction token_tis or sequence_tis; "
                    f"rollout_correction is {self.rollout_correction!r}. Set "
                    "rollout_correction: token_tis (what tis_cap alone meant before) or leave "
                    "tis_cap out",
                    param="tis_cap",
                )
        for name in ("mask_low", "mask_high"):
            value = getattr(self, name)
            if value is None:
                continue
            _check_number(name, value, low=0.0)
            if self.rollout_correction != "mask":
                raise ConfigError(
                    f"{name} bounds rollout_correction: mask; rollout_correction is "
                    f"{self.rollout_correction!r}",
                    param=name,
                )
        low, high = self.mask_band
        if low >= high:
            raise ConfigError(
                f"mask_low ({low}) must be below mask_high ({high})", param="mask_low"
            )
        _check_choice("loss_agg", self.loss_agg, LOSS_AGGS)
        value = self.max_response_len
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ConfigError(
                f"max_response_len must be an integer >= 1; got {value!r}",
                param="max_response_len",
            )
        if self.loss_agg == "seq_mean_token_sum_norm" and value is None:
            raise ConfigError(
                'loss_agg="seq_mean_token_sum_norm" divides by max_response_len; set it to the '
                "rollout's maximum number of response tokens",
                param="max_response_len",
            )

    @property
    def clip_range(self) -> tuple[float, float]:
        """(clip_low, clip_high), each the ratio level's default where not set."""
        low, high = DEFAULT_CLIP[self.ratio_level]
        return (
            low if self.clip_low is None else self.clip_low,
            high if self.clip_high is None else self.clip_high,
        )

    @property
    def cap(self) -> float:
        """The truncated importance weight's cap (token_tis, sequence_tis)."""
        return DEFAULT_TIS_CAP if self.tis_cap is None else self.tis_cap

    @property
    def mask_band(self) -> tuple[float, float]:
        """The proximal / sampler ratios `rollout_correction: mask` keeps, inclusive."""
        low, high = DEFAULT_MASK_BAND
        return (
            low if self.mask_low is None else self.mask_low,
            high if self.mask_high is None else self.mask_high,
        )


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {choices}; got {value!r}", param=name)


def _check_number(
    name: str,
    value: object,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high
        )
    if not ok:
        bounds = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ConfigError(f"{name} must be a number in {bounds}; got {value!r}", param=name)


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[int],
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, over (group std + eps) if asked.

    rewards: [B]; group_ids: [B], one id per sample, samples of one prompt sharing an id. Groups
    need not be contiguous. The std is the population std (unbiased=False): for the fixed group
    size of GRPO the choice only rescales advantages, and it keeps a group of two rewards {0, 1}
    at advantages -1 / +1. A group of one sample, or of equal rewards, gets advantage 0.
    Returns float32 [B].
    """
    ids = torch.as_tensor(group_ids, device=rewards.device)
    if rewards.dim() != 1 or ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be 1-D of the same length; got shapes "
            f"{tuple(rewards.shape)} and {tuple(ids.shape)}"
        )
    values = rewards.double()
    _, inverse = torch.unique(ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    counts = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    counts.index_add_(0, inverse, torch.ones_like(values))
    sums = torch.zeros_like(counts).index_add_(0, inverse, values)
    centred = values - (sums / counts)[inverse]
    if normalize_std:
        sq_sums = torch.zeros_like(counts).index_add_(0, inverse, centred.square())
        std = (sq_sums / counts).sqrt()[inverse]
        centred = centred / (std + eps)
    # NOTE: exact zero for singletons, whatever rounding the mean had.
    centred = torch.where(counts[inverse] > 1, centred, torch.zeros_like(centred))
    return centred.float()


def token_logprobs(logits_BTV: Tensor, token_ids_BT: Tensor) -> Tensor:
    """log softmax(logits)[token] for each position: [B, T, V], [B, T] -> float32 [B, T].

    Rows are done one at a time so that only one row's float32 copy of the logits exists at
    once, not a full [B, T, V] log-softmax.
    """
    if logits_BTV.dim() != 3 or token_ids_BT.shape != logits_BTV.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and token_ids [B, T]; got shapes "
            f"{tuple(logits_BTV.shape)} and {tuple(token_ids_BT.shape)}"
        )
    rows = []
    for logits_TV, ids_T in zip(logits_BTV, token_ids_BT, strict=True):
        logits_TV = logits_TV.float()
        picked_T = logits_TV.gather(-1, ids_T.long().unsqueeze(-1)).squeeze(-1)
        rows.append(picked_T - torch.logsumexp(logits_TV, dim=-1))
    return torch.stack(rows)


@dataclass
class LossTerms:
    """`policy_loss_terms`: the per-token loss and its metrics' sums, still on the device, so
    that a batch of sequences is scored with one read of the host."""

    token_loss: Tensor  # [B, T], 0 at masked positions; differentiable in the log-probs
    weights: Tensor  # [B, T] float: 1 at the valid (masked-in) tokens
    # sums over the valid tokens (0-d tensors): "clip" (the clipped branch taken), "ratio",
    # with a rollout correction "tis", "capped" and "masked", with ref_logprobs "kl" (k3)
    sums: dict[str, Tensor]
    ratio_max: Tensor  # 0-d: the largest ratio over the valid tokens, 0 over none

    def sequence_losses(self, config: GRPOLossConfig) -> Tensor:
        """[B]: each sequence's loss as `policy_loss` aggregates a batch of that sequence alone
        (token means: its token sum over its valid tokens, 0 for none; Dr.GRPO: over
        max_response_len)."""
        seq_sums = self.token_loss.sum(dim=-1)
        if config.loss_agg == "seq_mean_token_sum_norm":
            return seq_sums / config.max_response_len
        return seq_sums / self.weights.sum(dim=-1).clamp(min=1.0)


# `policy_loss`'s metrics: their names and the `LossTerms.sums` each is the token mean of
METRIC_SUMS = {
    "clip_fraction": "clip",
    "ratio_mean": "ratio",
    "tis_weight_mean": "tis",
    "tis_capped_fraction": "capped",
    "masked_fraction": "masked",
    "kl": "kl",
}


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    config: GRPOLossConfig,
    ref_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO loss (scalar, differentiable in `logprobs`) and its metrics.

    logprobs: [B, T] under the policy being trained; old_logprobs: [B, T] under the policy that
    the training step started from; advantages: [B], one per sequence; loss_mask: [B, T];
    ref_logprobs: [B, T] under the frozen reference (needed when config.kl_coef > 0);
    rollout_logprobs: [B, T] as the inference engine reported them (needed with a
    config.rollout_correction). Everything but `logprobs` is treated as a constant.

    Per token: -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A), plus kl_coef * k3,
    aggregated by config.loss_agg. r is exp(logprobs - old_logprobs) (ratio_level "token"), or
    the sequence's exp(mean of those log-ratios) with each token's own gradient (GSPO's
    sg[s] * pi / sg[pi], "sequence"); w is the rollout correction's weight (1 when off).
    Metrics: "clip_fraction" (valid tokens whose clipped branch was the one taken),
    "ratio_mean", "ratio_max", "kl" (mean k3, when ref_logprobs is given); with a rollout
    correction "tis_weight_mean", "tis_capped_fraction" (tokens whose weight hit tis_cap) and
    "masked_fraction" (tokens weighted 0 by the mask). Means over no valid tokens are 0.
    """
    terms = policy_loss_terms(
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        config=config,
        ref_logprobs=ref_logprobs,
        rollout_logprobs=rollout_logprobs,
    )
    count = terms.weights.sum().clamp(min=1.0)
    metrics = {
        name: float(terms.sums[key] / count)
        for name, key in METRIC_SUMS.items()
        if key in terms.sums
    }
    metrics["ratio_max"] = float(terms.ratio_max)
    return _aggregate(terms.token_loss, terms.weights, config), metrics


def policy_loss_terms(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    config: GRPOLossConfig,
    ref_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
) -> LossTerms:
    """`policy_loss`'s per-token loss and metric sums, before the aggregate, without reading
    anything back from the device (its arguments and their meaning are `policy_loss`'s)."""
    _check_bt(logprobs, old_logprobs=old_logprobs, loss_mask=loss_mask)
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be [B] = {tuple(logprobs.shape[:1])}; got {tuple(advantages.shape)}"
        )
    mask = loss_mask.bool()
    weights = mask.float()
    logprobs = logprobs.float()
    # NOTE: masked positions may hold anything (padding, -inf); `where` keeps them, and their
    # gradients, out of every sum below.
    log_ratio = torch.where(mask, logprobs - old_logprobs.detach().float(), 0.0)
    if config.ratio_level == "sequence":
        # GSPO: log s_i = the mean of the sequence's token log-ratios; each token carries
        # sg[log s_i] + log pi(y_t) - sg[log pi(y_t)]: the value s_i, the gradient
        # s_i * grad log pi(y_t), which the sequence's token mean turns into grad s_i.
        counts = weights.sum(dim=-1, keepdim=True).clamp(min=1.0)
        seq_log_ratio = (log_ratio.detach().sum(dim=-1, keepdim=True) / counts).expand_as(mask)
        own = torch.where(mask, logprobs, 0.0)
        log_ratio = torch.where(mask, seq_log_ratio + own - own.detach(), 0.0)
    ratio = log_ratio.exp()
    adv = advantages.detach().float().unsqueeze(-1)
    low, high = config.clip_range
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    token_loss = torch.maximum(unclipped, clipped)
    valid_ratio = torch.where(mask, ratio.detach(), 0.0)
    sums = {
        "clip": ((clipped > unclipped).float() * weights).sum(),
        "ratio": valid_ratio.sum(),
    }
    # a ratio is positive: 0 at the invalid tokens leaves the max over the valid ones
    ratio_max = valid_ratio.max() if valid_ratio.numel() else valid_ratio.new_zeros(())
    if config.rollout_correction != "off":
        if rollout_logprobs is None:
            raise ValueError(
                f"config.rollout_correction is {config.rollout_correction!r}: pass "
                "rollout_logprobs to policy_loss"
            )
        _check_bt(logprobs, rollout_logprobs=rollout_logprobs)
        weight, capped, masked = correction_weight(
            old_logprobs.detach().float(), rollout_logprobs.detach().float(), mask, config
        )
        token_loss = token_loss * weight
        sums["tis"] = (weight * weights).sum()
        sums["capped"] = (capped.float() * weights).sum()
        sums["masked"] = (masked.float() * weights).sum()
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("config.kl_coef > 0: pass ref_logprobs to policy_loss")
    if ref_logprobs is not None:
        _check_bt(logprobs, ref_logprobs=ref_logprobs)
        delta = torch.where(mask, ref_logprobs.detach().float() - logprobs, 0.0)
        k3 = delta.exp() - delta - 1.0
        sums["kl"] = (k3.detach() * weights).sum()
        if config.kl_coef > 0:
            token_loss = token_loss + config.kl_coef * k3
    token_loss = torch.where(mask, token_loss, 0.0)
    return LossTerms(token_loss, weights, sums, ratio_max)


def correction_weight(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, config: GRPOLossConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """Each token's rollout-correction weight [B, T] from the proximal (`old_logprobs`) and
    sampler (`rollout_logprobs`) logprobs, and where it was capped / masked (bool [B, T]).

    token_tis: min(proximal / sampler, cap); sequence_tis: min(prod over the sequence's valid
    tokens of proximal / sampler, cap) on each of them; mask: 1 where proximal / sampler is
    within [mask_low, mask_high], else 0 (the token stays in the aggregate's normaliser, as in
    IcePop's objective). A constant: no gradient flows through it."""
    log_w = torch.where(mask, old_logprobs - rollout_logprobs, 0.0)
    none = torch.zeros_like(mask)
    kind = config.rollout_correction
    if kind == "token_tis":
        capped = mask & (log_w > math.log(config.cap))
        return log_w.exp().clamp(max=config.cap), capped, none
    if kind == "sequence_tis":
        # summed in log space: a long sequence's product over- or underflows float32
        log_seq = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)
        capped = mask & (log_seq > math.log(config.cap))
        return log_seq.clamp(max=math.log(config.cap)).exp(), capped, none
    if kind == "mask":
        low, high = config.mask_band
        ratio = log_w.exp()
        masked = mask & ((ratio < low) | (ratio > high))
        return (~masked).float(), none, masked
    raise ValueError(f"no correction weight for rollout_correction {kind!r}")


def _aggregate(token_loss: Tensor, weights: Tensor, config: GRPOLossConfig) -> Tensor:
    if config.loss_agg == "token_mean":
        return token_loss.sum() / weights.sum().clamp(min=1.0)
    seq_sums = token_loss.sum(dim=-1)
    if config.loss_agg == "seq_mean_token_sum_norm":
        # Dr.GRPO: a constant normaliser, so no sequence's tokens count more for being short.
        return seq_sums.mean() / config.max_response_len
    seq_counts = weights.sum(dim=-1)
    # Sequences without a valid token have no mean; they are left out of the mean over sequences.
    has_tokens = seq_counts > 0
    seq_means = seq_sums / seq_counts.clamp(min=1.0)
    return (seq_means * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def _check_bt(reference: Tensor, **tensors: Tensor) -> None:
    if reference.dim() != 2:
        raise ValueError(f"log-probs must be [B, T]; got shape {tuple(reference.shape)}")
    for name, tensor in tensors.items():
        if tensor.shape != reference.shape:
            raise ValueError(
                f"{name} must have the log-probs' shape {tuple(reference.shape)}; "
                f"got {tuple(tensor.shape)}"
            )
