"""Start-up prompts: one encoded synthetic item per modality of each family."""

from __future__ import annotations

import pytest

from areno.processing import Processor, PromptLimits
from areno.processing.warmup import warm_up_prompts

FAMILIES = ["qwen3_5", "qwen3_vl", "minicpmv4_6", "gemma4"]


@pytest.mark.parametrize("family", FAMILIES)
def test_one_prompt_per_modality_with_its_media_tensors(tiny_path, family):
    processor = Processor(tiny_path(family))
    prompts = warm_up_prompts(processor)
    assert set(prompts) == set(processor.adapter.modalities)
    for modality, prompt in prompts.items():
        assert [span.modality for span in prompt.mm_spans][:1] == [modality]
        assert prompt.mm_inputs, modality
        # The placeholders were expanded: the prompt is longer than its text alone.
        assert prompt.num_prompt_tokens > 20


def test_a_prompt_over_the_limits_is_left_out(tiny_path):
    path = tiny_path("gemma4")
    full = warm_up_prompts(Processor(path))
    longest = max(full, key=lambda m: full[m].num_prompt_tokens)
    limit = full[longest].num_prompt_tokens - 1
    kept = warm_up_prompts(Processor(path, limits=PromptLimits(max_prompt_tokens=limit)))
    assert longest not in kept
    assert set(kept) == {m for m, p in full.items() if p.num_prompt_tokens <= limit}
