"""The engine's gated-delta-net paths compute what transformers' own layer code computes."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from areno.engine.layers import linear_attention
from areno.engine.layers.linear_attention import EngineKernels
from areno.processing import Processor

VOCAB = 200  # ids below the tiny tokenizer's special tokens


@pytest.fixture(scope="module")
def model(tiny_path):
    path = tiny_path("qwen3_5")
    return Processor(path).adapter.load_model(path).eval()


def run(model, ids_BL, mask_BL, num_decode: int) -> list[torch.Tensor]:
    """Logits of a prefill of `ids_BL` then `num_decode` greedy one-token steps, with
    transformers' DynamicCache."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids_BL, attention_mask=mask_BL, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    mask = mask_BL
    for _ in range(num_decode):
        next_B1 = logits[-1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(next_B1)], dim=1)
        out = model(input_ids=next_B1, attention_mask=mask, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return logits


def counted(monkeypatch, name: str) -> list:
    calls, original = [], getattr(linear_attention, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(linear_attention, name, wrapper)
    return calls


@torch.inference_mode()
def test_prefill_and_decode_match_transformers_with_left_padding(model, monkeypatch):
    kernels = EngineKernels(model)
    prefills, decodes = counted(monkeypatch, "prefill_step"), counted(monkeypatch, "decode_step")
    assert kernels.num_layers == sum(
        t == "linear_attention" for t in model.config.get_text_config().layer_types
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 37), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding, as a padded batch carries it
    mask[2, :20] = 0

    expected = run(model, ids, mask, num_decode=6)
    assert not prefills and not decodes
    with kernels:
        got = run(model, ids, mask, num_decode=6)
    assert len(prefills) == kernels.num_layers and len(decodes) == 6 * kernels.num_layers
    for step, (e, g) in enumerate(zip(expected, got, strict=True)):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        assert torch.equal(g.argmax(-1), e.argmax(-1))


@torch.inference_mode()
def test_kernels_are_inactive_outside_their_context(model):
    """Installed twice over the same model and left: transformers' path runs, bit for bit."""
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    before = run(model, ids, mask, num_decode=2)
    EngineKernels(model)
    after = run(model, ids, mask, num_decode=2)
    for b, a in zip(before, after, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", ["prefill_delta_rule", "recurrent_update"])
def test_the_custom_ops_match_their_fake_kernels(op):
    """opcheck runs each op for real and through its fake kernel (what torch.compile plans
    with): sizes, strides and dtypes must agree, or an inductor graph fails its layout check."""
    gen = torch.Generator().manual_seed(0)
    batch, tokens, key_heads, value_heads, dk, dv = 2, 5, 2, 4, 16, 8

    def rand(*shape):
        return torch.rand(*shape, generator=gen)

    if op == "prefill_delta_rule":
        args = (
            rand(batch, tokens, key_heads, dk),
            rand(batch, tokens, key_heads, dk),
            rand(batch, tokens, value_heads, dv),
            rand(batch, tokens, value_heads),
            -rand(batch, tokens, value_heads),
        )
        fn = linear_attention.prefill_delta_rule
    else:
        args = (
            rand(batch, value_heads, dk, dv),
            rand(batch, value_heads),
            rand(batch, value_heads, dk),
            rand(batch, value_heads, dk),
            rand(batch, value_heads, dv),
            rand(batch, value_heads),
        )
        fn = linear_attention.recurrent_update
    torch.library.opcheck(fn, args)
