"""`sequence_logprobs`, the one forward that SFT and the GRPO loss score trajectories with, on
the tiny checkpoint of every family; the check that decides whether the trainer packs a group's
episodes into one row on a model."""

from __future__ import annotations

import pytest
import torch

from areno.models.tiny import TINY_FAMILIES
from areno.processing.processor import Processor
from areno.train import packing
from areno.train.policy import load_policy, pack_layout, sequence_logprobs


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_sequence_logprobs_scores_exactly_the_tokens_after_start(tiny_path, family):
    """One logprob per token from `start` on, equal to the full forward's log-softmax, also for
    a family whose forward ignores `logits_to_keep` (MiniCPM-V 4.6 returns every position)."""
    path = tiny_path(family)
    inputs = Processor(path).encode([{"role": "user", "content": "Score me, please."}], [])
    model, _, _ = load_policy(path, dtype=torch.float32)
    start = inputs.num_prompt_tokens - 3
    with torch.no_grad():
        scored = sequence_logprobs(model, inputs, "cpu", start)
        logits = model(**inputs.model_inputs(), use_cache=False).logits[0].float()
    ids = torch.tensor(inputs.input_ids)
    expected = logits[start - 1 : -1].log_softmax(-1).gather(1, ids[start:, None])[:, 0]
    assert scored.shape == (inputs.num_prompt_tokens - start,)
    torch.testing.assert_close(scored, expected)


def test_sequence_logprobs_at_a_temperature_divide_the_logits(tiny_path):
    path = tiny_path("qwen3_5")
    inputs = Processor(path).encode([{"role": "user", "content": "Warm me up."}], [])
    model, _, _ = load_policy(path, dtype=torch.float32)
    start = inputs.num_prompt_tokens - 4
    with torch.no_grad():
        tempered = sequence_logprobs(model, inputs, "cpu", start, temperature=0.5)
        greedy = sequence_logprobs(model, inputs, "cpu", start, temperature=0.0)
        logits = model(**inputs.model_inputs(), use_cache=False).logits[0].float()
    ids = torch.tensor(inputs.input_ids)
    expected = (logits[start - 1 : -1] / 0.5).log_softmax(-1).gather(1, ids[start:, None])[:, 0]
    torch.testing.assert_close(tempered, expected)
    # temperature 0 (a greedy rollout) scores the model's own distribution
    raw = logits[start - 1 : -1].log_softmax(-1).gather(1, ids[start:, None])[:, 0]
    torch.testing.assert_close(greedy, raw)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_family_packs_after_its_packed_row_checks_out(tiny_path, family):
    model, _, _ = load_policy(tiny_path(family), dtype=torch.float32)
    model.train()
    assert pack_layout(model, "cpu") == packing.PackLayout.of(model) is not None
    assert model.training  # the check's eval mode is undone


def test_a_packed_row_that_scores_otherwise_trains_one_trajectory_a_row(
    tiny_path, monkeypatch, caplog
):
    """Linear-attention layers run through transformers' own layer code: where it reads its
    cache otherwise (another transformers version), the check fails and the trainer does not
    pack, saying so."""
    model, _, _ = load_policy(tiny_path("qwen3_5"), dtype=torch.float32)

    def stale(self, inputs, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        return inputs  # as if the layer's cache kept no earlier inputs

    monkeypatch.setattr(packing._Branch, "update_conv_state", stale)
    assert pack_layout(model, "cpu") is None
    assert "differ from the unpacked ones" in caplog.text


def test_rows_batched_into_one_linear_attention_forward_keep_their_own_states(
    tiny_path, monkeypatch, caplog
):
    """A step's groups run their prompts through a linear-attention layer as one left-padded
    batch; the packing check packs two groups of different prompt lengths, so a row that took
    another row's end states fails it."""
    assert packing.shared_batches([12, 0, 10, 40, 11]) == [[3], [0, 4, 2]]
    assert packing.shared_batches([12, 10], waste=0.0) == [[0], [1]]  # a biased layer
    assert packing.shared_batches([12, 12], waste=0.0) == [[0, 1]]
    model, _, _ = load_policy(tiny_path("qwen3_5"), dtype=torch.float32)
    assert pack_layout(model, "cpu") is not None

    of = packing._SegmentPlan.of

    def swapped(*args, **kwargs):
        plan = of(*args, **kwargs)
        plan.rest_states = plan.rest_states.flip(0)  # the rests of row 0 from row 1's states
        return plan

    monkeypatch.setattr(packing._SegmentPlan, "of", swapped)
    assert pack_layout(model, "cpu") is None
    assert "differ from the unpacked ones" in caplog.text


def test_a_lora_learner_starts_from_the_adapter_its_seed_gives(tiny_path, process_group):
    """A LoRA run's initial factors come from `run.seed`: the same seed gives the same adapter
    (two runs of one config train alike; unseeded, each drew its own lora_A and the runs parted
    at their second step), another seed another adapter."""
    from areno.train.config import GRPOConfig
    from areno.train.learner import Learner

    path = str(tiny_path("qwen3_5"))

    def initial_factors(seed: int) -> dict[str, torch.Tensor]:
        config = GRPOConfig.from_dict(
            {"model_path": path, "lora": {"rank": 4, "alpha": 8}, "run": {"seed": seed}}
        )
        learner = Learner(config, path, 0, 1)
        return {
            n: p.detach().clone() for n, p in learner.module.named_parameters() if p.requires_grad
        }

    first, again, other = initial_factors(0), initial_factors(0), initial_factors(1)
    assert first and all(".lora_" in name for name in first)
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert any(not torch.equal(first[name], other[name]) for name in first if "lora_A" in name)


def test_the_packing_check_runs_in_float32_and_sees_a_bug_bfloat16_would_hide(
    tiny_path, monkeypatch, caplog
):
    """A packed row whose second episode sees one token of the first (a mask bug) moves its
    logprobs by ~0.016: inside what bfloat16 rounding allows, far outside float32's. The check
    runs on a float32 probe of the model's class and config, so a bfloat16 policy packs when
    packing is right and does not when it leaks."""
    model, _, _ = load_policy(tiny_path("qwen3_5"), dtype=torch.bfloat16)
    assert pack_layout(model, "cpu") == packing.PackLayout.of(model) is not None
    state = torch.random.get_rng_state()
    masks = packing.PackLayout.masks

    def leaky(self, seg_BT, pos_BT, groups_BT, dtype):
        out = masks(self, seg_BT, pos_BT, groups_BT, dtype)
        first = (seg_BT == 1) & (torch.cumsum((seg_BT == 1).int(), -1) == 1)
        leak = ((seg_BT == 2)[:, :, None] & first[:, None, :])[:, None]
        return {
            kind: None if mask is None else mask.masked_fill(leak, 0.0)
            for kind, mask in out.items()
        }

    monkeypatch.setattr(packing.PackLayout, "masks", leaky)
    assert pack_layout(model, "cpu") is None
    assert "in float32" in caplog.text
    assert torch.equal(torch.random.get_rng_state(), state)  # the probe drew nothing of ours
