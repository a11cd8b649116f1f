"""Sampler: greedy, raw-logit logprobs, top-k / top-p / min-p, per-row seeds, distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from areno.engine.kernels import INTERPRETED
from areno.engine.sample import sampler
from areno.engine.sample.sampler import (
    SamplingTensors,
    key_uniforms,
    row_keys,
    sample,
    seeded_keys,
)
from areno.engine.sampling import SamplingParams

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def run(logits_BV: torch.Tensor, params: list[SamplingParams], keys_B=None):
    tensors = SamplingTensors.from_params(params, logits_BV.device)
    if keys_B is None:
        keys_B = row_keys([None] * len(params), [0] * len(params), logits_BV.device)
    return sample(logits_BV, tensors, keys_B)


def keys_for(uniforms: list[float]) -> torch.Tensor:
    """Keys whose uniform numbers (`key_uniforms`) are `uniforms` (multiples of 2**-53)."""
    words = [int(u * 2**53) << 11 for u in uniforms]
    return torch.tensor([w - 2**64 if w >= 2**63 else w for w in words], dtype=torch.int64)


def random_logits(rows: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def frequencies(params: SamplingParams, draws: int = 20_000) -> torch.Tensor:
    torch.manual_seed(1234)
    logits = PROBS.log().expand(draws, -1).contiguous()
    tokens = run(logits, [params] * draws).token_ids_B
    return torch.bincount(tokens, minlength=len(PROBS)).float() / draws


def test_greedy_is_argmax() -> None:
    logits = random_logits()
    out = run(logits, [SamplingParams(temperature=0)] * 6)
    assert torch.equal(out.token_ids_B, logits.argmax(-1))


def test_greedy_rows_in_a_mixed_batch() -> None:
    logits = random_logits()
    params = [SamplingParams(temperature=0 if i % 2 else 1.5, top_k=3) for i in range(6)]
    out = run(logits, params)
    assert torch.equal(out.token_ids_B[1::2], logits[1::2].argmax(-1))


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = random_logits()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.05, logprobs=True)] * 6
    out = run(logits, params)
    expected = torch.log_softmax(logits, -1).gather(-1, out.token_ids_B[:, None]).squeeze(-1)
    assert torch.allclose(out.logprobs_B, expected, atol=1e-6, rtol=0)
    assert out.logprobs_B.dtype == torch.float32


def test_logprobs_are_computed_only_when_a_row_asks() -> None:
    logits = random_logits()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7)] * 3
    out = run(logits, params)
    assert torch.equal(out.logprobs_B, torch.zeros(6))  # nobody asked: no log-softmax pass
    out = run(logits, params[:5] + [SamplingParams(logprobs=True)])
    expected = torch.log_softmax(logits, -1).gather(-1, out.token_ids_B[:, None]).squeeze(-1)
    assert torch.allclose(out.logprobs_B, expected, atol=1e-6, rtol=0)


def test_tempered_logprobs_divide_by_each_rows_temperature() -> None:
    logits = random_logits()
    temps = [0.5, 0.5, 1.3, 0.0, 0.5, 2.0]
    modes = ["tempered", "raw", "tempered", "tempered", "tempered", "tempered"]
    params = [
        SamplingParams(temperature=t, top_k=5, logprobs=True, top_logprobs=3, logprobs_mode=m)
        for t, m in zip(temps, modes, strict=True)
    ]
    out = run(logits, params)
    # A raw row and a greedy row (temperature 0: no distribution to temper) stay raw.
    divisors = torch.tensor([0.5, 1.0, 1.3, 1.0, 0.5, 2.0])[:, None]
    expected_BV = torch.log_softmax(logits / divisors, -1)
    chosen = expected_BV.gather(-1, out.token_ids_B[:, None]).squeeze(-1)
    assert torch.allclose(out.logprobs_B, chosen, atol=1e-6, rtol=0)
    assert torch.allclose(out.top_logprobs_BK, expected_BV.topk(3, -1).values, atol=1e-6, rtol=0)


def test_an_unknown_logprobs_mode_is_refused() -> None:
    from areno.errors import ConfigError

    with pytest.raises(ConfigError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="processed")


def test_top_logprobs_are_sorted_and_use_the_largest_k() -> None:
    logits = random_logits()
    params = [SamplingParams(logprobs=True, top_logprobs=k) for k in (0, 2, 5, 1, 0, 3)]
    out = run(logits, params)
    assert out.top_logprobs_BK.shape == (6, 5) and out.top_logprobs_ids_BK.shape == (6, 5)
    assert torch.all(out.top_logprobs_BK[:, :-1] >= out.top_logprobs_BK[:, 1:])
    logprobs = torch.log_softmax(logits, -1)
    assert torch.equal(out.top_logprobs_ids_BK, logprobs.topk(5, -1).indices)
    gathered = logprobs.gather(-1, out.top_logprobs_ids_BK)
    assert torch.allclose(out.top_logprobs_BK, gathered, atol=1e-6, rtol=0)


def test_no_top_logprobs_gives_empty_columns() -> None:
    out = run(random_logits(), [SamplingParams()] * 6)
    assert out.top_logprobs_BK.shape == (6, 0) and out.top_logprobs_ids_BK.shape == (6, 0)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)],
    ids=["top_k=1", "tiny top_p", "min_p=1"],
)
def test_filters_that_leave_one_token_equal_greedy(params: SamplingParams) -> None:
    logits = random_logits(rows=64, seed=3)
    torch.manual_seed(0)
    out = run(logits, [params] * 64)
    assert torch.equal(out.token_ids_B, logits.argmax(-1))


def test_banned_ids_are_never_chosen_and_logprobs_stay_raw() -> None:
    """Media placeholders are banned: neither greedy nor sampled rows pick them, even when they
    are the most likely, and the reported logprobs are still the raw distribution's."""
    logits = random_logits(rows=200)
    banned = logits[:, :10].argmax(-1).unique()  # tokens that win many rows
    logits[:, banned] += 20.0
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, logprobs=True) for i in range(200)]
    tensors = SamplingTensors.from_params(params, "cpu")
    out = sample(logits, tensors, row_keys([None] * 200, [0] * 200, "cpu"), banned_ids=banned)
    assert not torch.isin(out.token_ids_B, banned).any()
    expected = torch.log_softmax(logits, -1).gather(-1, out.token_ids_B[:, None]).squeeze(-1)
    assert torch.allclose(out.logprobs_B, expected, atol=1e-6, rtol=0)


def test_sampling_follows_the_distribution() -> None:
    assert torch.allclose(frequencies(SamplingParams()), PROBS, atol=0.02)


def test_seeded_draws_follow_the_distribution() -> None:
    """One row drawing 20,000 tokens in turn, and 20,000 seeds drawing their first."""
    logits = PROBS.log().expand(20_000, -1).contiguous()
    for seeds, draws in (([3] * 20_000, range(20_000)), (range(20_000), [0] * 20_000)):
        keys_B = row_keys(list(seeds), list(draws), "cpu")
        tokens = run(logits, [SamplingParams(seed=0)] * 20_000, keys_B).token_ids_B
        seen = torch.bincount(tokens, minlength=len(PROBS)).float() / 20_000
        assert torch.allclose(seen, PROBS, atol=0.02)


def test_temperature_reshapes_the_distribution() -> None:
    expected = PROBS.sqrt() / PROBS.sqrt().sum()  # temperature 2 halves the log-probabilities
    assert torch.allclose(frequencies(SamplingParams(temperature=2.0)), expected, atol=0.02)


def test_top_k_and_top_p_renormalise_the_kept_tokens() -> None:
    kept = torch.tensor([0.625, 0.375, 0.0, 0.0])
    assert torch.allclose(frequencies(SamplingParams(top_k=2)), kept, atol=0.02)
    # 0.5 + 0.3 reaches 0.8; the third token is needed only above it.
    assert torch.allclose(frequencies(SamplingParams(top_p=0.75)), kept, atol=0.02)
    kept3 = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert torch.allclose(frequencies(SamplingParams(top_p=0.85)), kept3, atol=0.02)


@pytest.mark.parametrize("scale", [1.0, 3.0, 8.0])
def test_top_k_and_top_p_over_the_best_tokens_keep_what_the_whole_sort_keeps(
    scale, monkeypatch, whole_sorts
) -> None:
    """The filters over each row's best tokens (`topk`) remove what a sort of the whole row
    removes, for every mix of rows: top-k alone, top-p with and without a top_k, neither. A
    peaked row finds its top_p in the window; a flat one (scale 1) does not, and then the whole
    sort runs."""
    monkeypatch.setattr(sampler, "TOP_P_WINDOW", 256)
    mixes = [
        [SamplingParams(top_p=0.9)] * 3,
        [SamplingParams(top_k=20), SamplingParams(), SamplingParams(top_k=50, top_p=0.8)],
        [SamplingParams(top_k=10, top_p=0.5), SamplingParams(top_k=40, top_p=0.95)],
        [SamplingParams(top_p=0.9), SamplingParams(top_k=30), SamplingParams(temperature=0)],
    ]
    generator = torch.Generator().manual_seed(0)
    for params in mixes:
        tensors = SamplingTensors.from_params(params, "cpu")
        logits = torch.randn(len(params), 5000, generator=generator) * scale
        before = whole_sorts["n"]
        have = sampler._filter(logits, tensors)
        windowed = whole_sorts["n"] == before
        want = sampler._sorted_filter(logits, tensors)
        assert torch.equal(have.isinf(), want.isinf())
        assert torch.equal(have[~have.isinf()], want[~want.isinf()])
        # Rows with a top_k bound their top-p: never the whole sort. Without: the window is
        # enough once the row is peaked.
        if all(p.top_k > 0 for p in params if p.top_p < 1) or scale == 8.0:
            assert windowed


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    # Threshold 0.4 * 0.5 = 0.2: tokens 2 and 3 go.
    kept = torch.tensor([0.625, 0.375, 0.0, 0.0])
    assert torch.allclose(frequencies(SamplingParams(min_p=0.4)), kept, atol=0.02)


def test_mixed_filters_apply_per_row() -> None:
    rows = 300
    logits = PROBS.log().expand(3 * rows, -1).contiguous()
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_p=0.4)] * rows
    torch.manual_seed(0)
    tokens_R3 = run(logits, params).token_ids_B.view(rows, 3)
    assert torch.all(tokens_R3[:, 0] == 0) and torch.all(tokens_R3[:, 2] == 0)
    assert len(tokens_R3[:, 1].unique()) == 4  # the unfiltered rows still explore


def draws(logits_V: torch.Tensor, seed: int, batch_rows: int, steps: int = 20) -> list[int]:
    """Tokens the seeded row (placed in the middle of a batch of unseeded rows) draws over
    `steps` calls, draw k taking the row's k-th key."""
    params = SamplingParams(temperature=1.3, top_p=0.9, seed=seed)
    others = [SamplingParams(temperature=0.5, top_k=4), SamplingParams(min_p=0.1)]
    row = batch_rows // 2
    batch_params = [others[i % 2] for i in range(batch_rows)]
    batch_params[row] = params
    seeds = [None] * batch_rows
    seeds[row] = seed
    logits = random_logits(rows=batch_rows, vocab=logits_V.numel(), seed=99 + batch_rows)
    logits[row] = logits_V
    tensors = SamplingTensors.from_params(batch_params, logits.device)
    tokens = []
    for k in range(steps):
        keys_B = row_keys(seeds, [k] * batch_rows, "cpu")
        tokens.append(sample(logits, tensors, keys_B).token_ids_B[row].item())
    return tokens


def test_seeded_rows_are_reproducible_and_independent_of_the_batch() -> None:
    logits_V = random_logits(rows=1, vocab=200, seed=5)[0] / 3
    alone = draws(logits_V, seed=42, batch_rows=1)
    assert draws(logits_V, seed=42, batch_rows=1) == alone
    assert draws(logits_V, seed=42, batch_rows=5) == alone
    assert len(set(alone)) > 1  # it really samples
    assert draws(logits_V, seed=43, batch_rows=1) != alone


def test_seeded_keys_are_a_function_of_seed_and_draw_and_their_uniforms_look_uniform() -> None:
    for seed in (0, -1, -(2**63), 2**64 - 1):  # the protocol's whole range
        keys = seeded_keys([seed] * 3, [0, 1, 2])
        assert keys.dtype == np.uint64 and len(set(keys.tolist())) == 3
        assert np.array_equal(keys, seeded_keys([seed] * 3, [0, 1, 2]))
    # -1 and 2**64 - 1 are one seed modulo 2**64; seeds next to each other are not related.
    assert np.array_equal(seeded_keys([-1], [5]), seeded_keys([2**64 - 1], [5]))
    by_draw = row_keys([7] * 20_000, list(range(20_000)), "cpu")
    by_seed = row_keys(list(range(20_000)), [0] * 20_000, "cpu")
    for keys in (by_draw, by_seed):
        values = key_uniforms(keys).numpy()
        assert ((values >= 0) & (values < 1)).all()
        counts = np.bincount((values * 10).astype(int), minlength=10)
        assert counts.min() > 1_850 and counts.max() < 2_150  # 2,000 expected a tenth (~3.4 sd)
        # Neighbours are uncorrelated (a plain seed * k + draw mix would not be).
        assert abs(np.corrcoef(values[:-1], values[1:])[0, 1]) < 0.03


@pytest.mark.skipif(INTERPRETED, reason="the CPU path's draw; the interpreter takes the race")
def test_a_uniform_number_picks_where_the_cumulative_sum_passes_it() -> None:
    """Inverse sampling: for PROBS (0.5, 0.3, 0.15, 0.05) the numbers below 0.5 give token 0,
    up to 0.8 token 1, and so on; a removed token is never picked, at 0 or next to 1."""
    logits = PROBS.log().expand(6, -1).contiguous()
    keys = keys_for([0.0, 0.49, 0.51, 0.79, 0.81, 0.96])
    assert run(logits, [SamplingParams()] * 6, keys).token_ids_B.tolist() == [0, 0, 1, 1, 2, 3]
    edges = keys_for([0.0, 1 - 2**-53])
    removed_ends = torch.tensor([[-math.inf, 0.0, 1.0, -math.inf]] * 2)
    assert run(removed_ends, [SamplingParams()] * 2, edges).token_ids_B.tolist() == [1, 2]


def test_sample_accepts_low_precision_logits() -> None:
    logits = random_logits().to(torch.bfloat16)
    out = run(logits, [SamplingParams(temperature=0.8, top_k=10)] * 6)
    assert out.token_ids_B.dtype == torch.int64
    assert torch.all(torch.isfinite(out.logprobs_B)) and math.isfinite(out.logprobs_B.sum())


def test_the_host_copy_unpacks_every_field_exactly() -> None:
    params = [SamplingParams(logprobs=True, top_logprobs=k) for k in (0, 2, 3)]
    out = run(random_logits()[:3], params)
    token_ids, logprobs, top_ids, top_logprobs = type(out).unpack(out.packed().cpu())
    assert token_ids == out.token_ids_B.tolist() and all(type(t) is int for t in token_ids)
    assert logprobs == out.logprobs_B.tolist()
    assert (
        top_ids == out.top_logprobs_ids_BK.tolist() and top_logprobs == out.top_logprobs_BK.tolist()
    )
    # Large ids survive the float64 packing (Gemma's vocabulary is 262k).
    wide = type(out)(*(t.clone() for t in vars(out).values()))
    wide.token_ids_B += 262_000
    assert type(out).unpack(wide.packed())[0] == [t + 262_000 for t in token_ids]
