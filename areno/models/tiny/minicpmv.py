"""Tiny MiniCPM-V 4.6 checkpoint: SigLIP-style vision tower over a Qwen3.5 text model."""

from __future__ import annotations

import transformers as tf

from areno.models.tiny.common import TinyParts, load_template, train_tokenizer
from areno.models.tiny.qwen import CHAT_TOKENS, HYBRID_LAYERS, TOOL_TOKENS, text_config

MEDIA_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}
PATCH_SIZE = 14  # NOTE: the vision config defaults to 16, the processor to 14; they must agree


def _tokenizer() -> tf.PreTrainedTokenizerBase:
    return train_tokenizer(
        tf.Qwen3_5Tokenizer,
        byte_fallback=False,
        ctor_kwargs={"unk_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        special_tokens=["<|endoftext|>", *CHAT_TOKENS, *TOOL_TOKENS, *MEDIA_TOKENS.values()],
        named_tokens=MEDIA_TOKENS,
    )


def _config(tok: tf.PreTrainedTokenizerBase, size: str) -> tf.MiniCPMV4_6Config:
    # The merger projects vision features to the text hidden size itself.
    text = {"model_type": "qwen3_5_text", **text_config(tok, size), **HYBRID_LAYERS[size]}
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "patch_size": PATCH_SIZE,
        "image_size": 224,
        "insert_layer_id": 0,  # must be < num_hidden_layers
    }
    ids = tok.convert_tokens_to_ids
    return tf.MiniCPMV4_6Config(
        text_config=text,
        vision_config=vision,
        insert_layer_id=0,
        image_size=224,
        image_token_id=ids(MEDIA_TOKENS["image_token"]),
        video_token_id=ids(MEDIA_TOKENS["video_token"]),
    )


def build_minicpmv4_6(size: str = "tiny") -> TinyParts:
    tok = _tokenizer()
    media_kwargs = {"patch_size": PATCH_SIZE, "scale_resolution": 112}
    processor = tf.MiniCPMV4_6Processor(
        image_processor=tf.MiniCPMV4_6ImageProcessor(**media_kwargs),
        video_processor=tf.MiniCPMV4_6VideoProcessor(**media_kwargs),
        tokenizer=tok,
        chat_template=load_template("minicpmv4_6"),
    )
    model = tf.MiniCPMV4_6ForConditionalGeneration(_config(tok, size))
    return TinyParts(model, processor, eos_tokens=["<|im_end|>"])
