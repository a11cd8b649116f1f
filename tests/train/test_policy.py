"""`sequence_logprobs`, the one forward that SFT and the GRPO loss score trajectories with, on
the tiny checkpoint of every family."""

from __future__ import annotations

import pytest
import torch

from areno.models.tiny import TINY_FAMILIES
from areno.processing.processor import Processor
from areno.train.policy import load_policy, sequence_logprobs


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
