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


# Qwen3.5's hybrid stack: one gated-delta-net (linear attention) layer, one full-attention layer.
HYBRID_LAYERS = {
    "head_dim": 32,
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}


def text_config(tok: tf.PreTrainedTokenizerBase) -> dict:
    return {
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
    }


def _vision_common() -> dict:
    return {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 64,  # NOTE: must be a perfect square
    }


def build_qwen3_5() -> TinyParts:
    tok = _tokenizer(tf.Qwen3_5Tokenizer)
    text = (
        text_config(tok)
        | HYBRID_LAYERS
        | {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        }
    )
    config = tf.Qwen3_5Config(text_config=text, vision_config=_vision_common(), **_token_ids(tok))
    model = tf.Qwen3_5ForConditionalGeneration(config)
    return TinyParts(model, _processor(tok, "qwen3_5"), eos_tokens=["<|im_end|>"])


def build_qwen3_vl() -> TinyParts:
    tok = _tokenizer(tf.Qwen2Tokenizer)
    text = text_config(tok) | {
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    }
    vision = _vision_common() | {"deepstack_visual_indexes": [0]}
    config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, **_token_ids(tok))
    model = tf.Qwen3VLForConditionalGeneration(config)
    return TinyParts(model, _processor(tok, "qwen3_vl"), eos_tokens=["<|im_end|>"])
