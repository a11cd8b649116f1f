"""The engine's attention function equals transformers' SDPA, in the shapes decode and prefill use."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

from areno.engine.layers.attention import (
    ENGINE_SDPA,
    EngineAttention,
    engine_sdpa_forward,
    engine_sdpa_mask,
)


class Layer(torch.nn.Module):
    """What the attention functions read from a layer."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("q_len", [1, 5])
def test_engine_sdpa_equals_transformers_sdpa(groups, q_len):
    torch.manual_seed(0)
    batch, kv_heads, keys, dim = 3, 2, 12, 16
    query = torch.randn(batch, kv_heads * groups, q_len, dim)
    key, value = torch.randn(2, batch, kv_heads, keys, dim)
    # Per-row key lengths, as the engine's decode masks have them.
    lengths = torch.tensor([12, 7, 3])
    visible = torch.arange(keys)[None, :] < lengths[:, None]
    mask = visible[:, None, None, :].expand(batch, 1, q_len, keys)
    module = Layer(groups)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    got, _ = engine_sdpa_forward(module, query, key, value, mask, scaling=0.25)
    assert got.shape == want.shape == (batch, q_len, kv_heads * groups, dim)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_only_the_text_stack_of_an_sdpa_model_switches(tiny_path):
    from areno.models import get_adapter
    from areno.models.registry import read_model_type

    path = tiny_path("qwen3_vl")
    model = get_adapter(read_model_type(path)).load_model(path)
    text, vision = model.config.get_text_config(), model.config.vision_config
    towers_before = vision._attn_implementation
    with EngineAttention(model):
        assert text._attn_implementation == ENGINE_SDPA
        assert vision._attn_implementation == towers_before
    assert text._attn_implementation == "sdpa"


def test_a_plain_causal_prefill_mask_is_left_to_sdpa_also_while_compiling(monkeypatch):
    import transformers.masking_utils as masking_utils

    # As transformers decides on torch before 2.14 while tracing (never skip): the engine's
    # function must not rely on transformers' own skip, which torch 2.14 already grants here.
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    assert isinstance(sdpa_mask(2, 5, 5), torch.Tensor)

    def prefill_mask(hidden):
        return hidden * 2, engine_sdpa_mask(hidden.shape[0], hidden.shape[1], hidden.shape[1])

    torch._dynamo.reset()
    compiled = torch.compile(prefill_mask, backend="eager", fullgraph=True, dynamic=True)
    for length in (3, 7):
        _, mask = compiled(torch.zeros(2, length))
        assert mask is None
    assert engine_sdpa_mask(2, 5, 5) is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attention_mask": torch.tensor([[True] * 5, [True] * 3 + [False] * 2])},
        {"local_size": 3, "mask_function": sliding_window_causal_mask_function(3)},
        {"q_offset": 2, "kv_length": 7},
        {"kv_length": 9},
        {"allow_is_causal_skip": False},
    ],
    ids=["padding", "window", "offset", "more-keys", "no-skip"],
)
def test_every_other_mask_is_transformers_own(kwargs):
    args = {"batch_size": 2, "q_length": 5, "kv_length": 5, **kwargs}
    got, want = engine_sdpa_mask(**args), sdpa_mask(**args)
    if kwargs.get("kv_length") == 9:  # transformers' own skip: SDPA crops the keys to the queries
        assert got is want is None
    else:
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, want)


def test_a_sliding_window_mask_is_built_also_for_prompts_inside_the_window():
    """So that a compiled prefill sees a tensor for every prompt length, never None for some."""
    args = {"batch_size": 2, "q_length": 5, "kv_length": 5, "local_size": 8}
    args["mask_function"] = sliding_window_causal_mask_function(8)
    assert sdpa_mask(**args) is None
    got = engine_sdpa_mask(**args)
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got, sdpa_mask(**args, allow_is_causal_skip=False))
