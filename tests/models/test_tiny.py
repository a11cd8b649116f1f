"""Tiny checkpoints: built offline, reload with the Auto classes, and run forward."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoProcessor, AutoTokenizer

from areno.models import adapter_for_checkpoint
from areno.models.tiny import TINY_FAMILIES

TEXTS = [
    "Hello world!",
    "  leading spaces, ünïcode 中文 and emoji 🙂",
    '{"x": [1, 2.5, null]}\n\tend',
]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_reloads_and_runs_forward(tiny_path, family):
    path = tiny_path(family)
    adapter = adapter_for_checkpoint(path)
    assert adapter.model_type == family
    model = adapter.load_model(path).eval()
    num_params = sum(p.numel() for p in model.parameters())
    assert num_params < 400_000
    processor = AutoProcessor.from_pretrained(path)
    assert len(processor.tokenizer) == model.config.get_text_config().vocab_size
    ids = processor.tokenizer("Describe the scene.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tokenizer_round_trips(tiny_path, family):
    tok = AutoTokenizer.from_pretrained(tiny_path(family))
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_special_tokens_are_single_tokens(tiny_path, family):
    path = tiny_path(family)
    processor = AutoProcessor.from_pretrained(path)
    adapter = adapter_for_checkpoint(path)
    tok = processor.tokenizer
    for token in adapter.stop_tokens:
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token
    for modality in adapter.modalities:
        token_id = getattr(processor, f"{modality}_token_id")
        assert 0 <= token_id < len(tok)
    generation = json.loads((path / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    stop_ids = {tok.convert_tokens_to_ids(t) for t in adapter.stop_tokens}
    assert stop_ids <= set(eos if isinstance(eos, list) else [eos])


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_template_renders_tools_calls_and_responses(tiny_path, family):
    processor = AutoProcessor.from_pretrained(tiny_path(family))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "inspect_range",
                "description": "Look at a time range.",
                "parameters": {"type": "object", "properties": {"start": {"type": "number"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "You are careful."},
        {"role": "user", "content": [{"type": "text", "text": "What happens?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "inspect_range", "arguments": {"start": 1.5}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a dog barks"},
    ]
    text = processor.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert "inspect_range" in text and "Look at a time range." in text
    assert "1.5" in text and "a dog barks" in text and "You are careful." in text
    assert text.index("What happens?") < text.index("a dog barks")


def test_build_is_deterministic(tmp_path):
    from areno.models.tiny import build_tiny

    a = build_tiny("qwen3_vl", tmp_path / "a", seed=3)
    b = build_tiny("qwen3_vl", tmp_path / "b", seed=3)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
