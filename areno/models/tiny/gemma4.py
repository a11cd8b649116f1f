"""Tiny Gemma 4 checkpoint: image, audio and video, sliding + full attention with mixed head sizes."""

from __future__ import annotations

import transformers as tf

from areno.models.tiny.common import TinyParts, load_template, train_tokenizer

BASE_VOCAB = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
TURN_TOKENS = ["<|turn>", "<turn|>"]
TOOL_TOKENS = [
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
]
MEDIA_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}
# NOTE: Gemma4Processor adds <|video|> itself; it must already be in the vocab or its id would
# land past the embedding matrix.
VIDEO_TOKEN = "<|video|>"
SOFT_TOKENS_PER_IMAGE = 70  # the smallest value Gemma4ImageProcessor accepts


def _tokenizer() -> tf.PreTrainedTokenizerBase:
    return train_tokenizer(
        tf.GemmaTokenizer,
        byte_fallback=True,
        base_vocab=BASE_VOCAB,
        ctor_kwargs={},
        special_tokens=[*TURN_TOKENS, *TOOL_TOKENS, *MEDIA_TOKENS.values(), VIDEO_TOKEN],
        named_tokens=MEDIA_TOKENS,
    )


def _processor(tok: tf.PreTrainedTokenizerBase) -> tf.ProcessorMixin:
    image_kwargs = {
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "max_soft_tokens": SOFT_TOKENS_PER_IMAGE,
    }
    return tf.Gemma4Processor(
        feature_extractor=tf.Gemma4AudioFeatureExtractor(),
        image_processor=tf.Gemma4ImageProcessor(**image_kwargs),
        video_processor=tf.Gemma4VideoProcessor(**image_kwargs, num_frames=4),
        tokenizer=tok,
        chat_template=load_template("gemma4"),
        image_seq_length=SOFT_TOKENS_PER_IMAGE,
    )


# Text-model shapes per size. "small" (~30 M parameters) is for CPU benchmarks; the media towers
# stay tiny at every size. Full-attention layers use a wider head (global_head_dim), the real
# checkpoints' layout; the last layer must be full attention.
TEXT_SHAPES = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "hidden_size_per_layer_input": 8,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"],
        # As the larger Gemma 4 checkpoints: an image's or a frame's tokens see each other both
        # ways in the sliding layers (the tests cover that mask; E2B's is causal).
        "use_bidirectional_attention": "vision",
    },
    "small": {
        "hidden_size": 512,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "global_head_dim": 128,
        "hidden_size_per_layer_input": 64,
        # Shorter than the benchmark's longest sequences, so the sliding window really cuts.
        "sliding_window": 256,
        "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 2,
    },
    # A Gemma 4 E2B-like text stack, for GPU runs.
    "2b": {
        "hidden_size": 1536,
        "intermediate_size": 6144,
        "num_hidden_layers": 35,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "global_head_dim": 512,
        "hidden_size_per_layer_input": 256,
        "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
    },
}


def _config(tok: tf.PreTrainedTokenizerBase, size: str) -> tf.Gemma4Config:
    ids = tok.convert_tokens_to_ids
    text = {
        "vocab_size": len(tok),
        "vocab_size_per_layer_input": len(tok),
        **TEXT_SHAPES[size],
        "max_position_embeddings": 4096,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": [tok.eos_token_id, ids("<turn|>")],
        "bos_token_id": tok.bos_token_id,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "position_embedding_size": 256,
    }
    feature_size = tf.Gemma4AudioFeatureExtractor().feature_size
    audio = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        # NOTE: the first conv's channels must equal the feature extractor's feature size.
        "subsampling_conv_channels": [feature_size, 8],
        "output_proj_dims": 32,
    }
    return tf.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        image_token_id=ids(MEDIA_TOKENS["image_token"]),
        boi_token_id=ids(MEDIA_TOKENS["boi_token"]),
        eoi_token_id=ids(MEDIA_TOKENS["eoi_token"]),
        audio_token_id=ids(MEDIA_TOKENS["audio_token"]),
        boa_token_id=ids(MEDIA_TOKENS["boa_token"]),
        eoa_token_index=ids(MEDIA_TOKENS["eoa_token"]),
        video_token_id=ids(VIDEO_TOKEN),
    )


def build_gemma4(size: str = "tiny") -> TinyParts:
    tok = _tokenizer()
    processor = _processor(tok)
    model = tf.Gemma4ForConditionalGeneration(_config(tok, size))
    return TinyParts(model, processor, eos_tokens=["<eos>", "<turn|>"])
