"""Tiny Qwen-style checkpoints: qwen3_5 (hybrid linear/full attention) and qwen3_vl (dense).

Both use `Qwen3VLProcessor` (Qwen2-VL image processor + Qwen3-VL video processor) and ChatML.
"""

from __future__ import annotations

import transformers as tf

from areno.models.tiny.common import TinyParts, load_template, train_tokenizer

CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VISION_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}
_IMAGE_SIZE = {"shortest_edge": 64 * 64, "longest_edge": 256 * 256}
_VIDEO_SIZE = {"shortest_edge": 64 * 64, "longest_edge": 4 * 256 * 256}


def _tokenizer(tokenizer_class: type) -> tf.PreTrainedTokenizerBase:
    return train_tokenizer(
        tokenizer_class,
        byte_fallback=False,
        ctor_kwargs={"unk_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        special_tokens=["<|endoftext|>", *CHAT_TOKENS, *TOOL_TOKENS, *VISION_TOKENS.values()],
        named_tokens=VISION_TOKENS,
    )


def _processor(tok: tf.PreTrainedTokenizerBase, template: str) -> tf.ProcessorMixin:
    image_processor = tf.Qwen2VLImageProcessor(
        size=_IMAGE_SIZE, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    video_processor = tf.Qwen3VLVideoProcessor(
        size=_VIDEO_SIZE, patch_size=16, merge_size=2, temporal_patch_size=2, fps=2
    )
    return tf.Qwen3VLProcessor(
        image_processor=image_processor,
        video_processor=video_processor,
        tokenizer=tok,
        chat_template=load_template(template),
    )


def _token_ids(tok: tf.PreTrainedTokenizerBase) -> dict[str, int]:
    ids = tok.convert_tokens_to_ids
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }


# Text-model shapes per size. "small" (~30 M parameters) is for CPU benchmarks, where compute rather
# than Python overhead must dominate; "2b" has Qwen3.5-2B's text stack (for GPU runs; the tiny
# tokenizer's vocabulary keeps its embeddings small); media towers stay tiny at every size.
TEXT_SHAPES = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "small": {
        "hidden_size": 512,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    },
    "2b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    },
}

# Qwen3.5's hybrid stack: gated-delta-net (linear attention) layers between full-attention ones,
# 1:1 when tiny and 3:1 (the real checkpoints' ratio) when small. Twice as many value heads as
# key heads, as in the real checkpoints, so the key-head repeat path is exercised.
HYBRID_LAYERS = {
    "tiny": {
        "head_dim": 32,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
    },
    "small": {
        "head_dim": 64,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
    },
    "2b": {
        "head_dim": 256,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
    },
}
# NOTE: each mrope section sums to half the rotary dims: head_dim * partial_rotary_factor / 2 for
# Qwen3.5 (factor 0.25), head_dim / 2 for Qwen3-VL.
_QWEN3_5_MROPE = {"tiny": [2, 1, 1], "small": [4, 2, 2], "2b": [11, 11, 10]}
_QWEN3_VL_HEAD = {
    "tiny": {"head_dim": 16, "mrope_section": [4, 2, 2]},
    "small": {"head_dim": 64, "mrope_section": [12, 10, 10]},
    "2b": {"head_dim": 128, "mrope_section": [24, 20, 20]},
}


def text_config(tok: tf.PreTrainedTokenizerBase, size: str = "tiny") -> dict:
    """The family-independent text config fields, shaped for `size`."""
    return {
        "vocab_size": len(tok),
        **TEXT_SHAPES[size],
        "max_position_embeddings": 4096,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
    }


def _vision_common(text_hidden_size: int) -> dict:
    return {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": text_hidden_size,  # the merger projects into the text model
        "num_position_embeddings": 64,  # NOTE: must be a perfect square
    }


def build_qwen3_5(size: str = "tiny") -> TinyParts:
    tok = _tokenizer(tf.Qwen3_5Tokenizer)
    rope = {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": _QWEN3_5_MROPE[size],
        "mrope_interleaved": True,
    }
    text = text_config(tok, size) | HYBRID_LAYERS[size] | {"rope_parameters": rope}
    vision = _vision_common(text["hidden_size"])
    config = tf.Qwen3_5Config(text_config=text, vision_config=vision, **_token_ids(tok))
    model = tf.Qwen3_5ForConditionalGeneration(config)
    return TinyParts(model, _processor(tok, "qwen3_5"), eos_tokens=["<|im_end|>"])


def build_qwen3_vl(size: str = "tiny") -> TinyParts:
    tok = _tokenizer(tf.Qwen2Tokenizer)
    head = _QWEN3_VL_HEAD[size]
    rope = {
        "rope_type": "default",
        "rope_theta": 5e6,
        "mrope_section": head["mrope_section"],
        "mrope_interleaved": True,
    }
    text = text_config(tok, size) | {"head_dim": head["head_dim"], "rope_parameters": rope}
    vision = _vision_common(text["hidden_size"]) | {"deepstack_visual_indexes": [0]}
    config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, **_token_ids(tok))
    model = tf.Qwen3VLForConditionalGeneration(config)
    return TinyParts(model, _processor(tok, "qwen3_vl"), eos_tokens=["<|im_end|>"])
