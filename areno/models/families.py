"""The supported checkpoint families."""

from __future__ import annotations

from areno.models.registry import FamilyAdapter, register

_QWEN_VIDEO_KWARGS = {"videos_kwargs": {"cap_pixels_per_frame": True}}

QWEN3_5 = register(
    FamilyAdapter(
        model_type="qwen3_5",
        display_name="Qwen3.5",
        modalities=frozenset({"image", "video"}),
        media_towers=("model.visual",),
        projectors=("model.visual.merger",),
        tool_format="qwen3_xml",
        stop_tokens=("<|im_end|>",),
        processor_kwargs=_QWEN_VIDEO_KWARGS,
    )
)

QWEN3_VL = register(
    FamilyAdapter(
        model_type="qwen3_vl",
        display_name="Qwen3-VL",
        modalities=frozenset({"image", "video"}),
        media_towers=("model.visual",),
        projectors=("model.visual.merger", "model.visual.deepstack_merger_list"),
        tool_format="hermes_json",
        stop_tokens=("<|im_end|>",),
        processor_kwargs=_QWEN_VIDEO_KWARGS,
        # Its text config has no base_model_tp_plan: only lm_head would be sharded.
        supports_tp=False,
    )
)

GEMMA4 = register(
    FamilyAdapter(
        model_type="gemma4",
        display_name="Gemma 4",
        modalities=frozenset({"image", "audio", "video"}),
        media_towers=("model.vision_tower", "model.audio_tower"),
        projectors=("model.embed_vision", "model.embed_audio"),
        tool_format="gemma4",
        stop_tokens=("<turn|>",),
        video_with_audio=True,
        # The default plan row-shards embed_tokens, which Gemma 4 indexes directly (pad row) and
        # which lm_head is tied to; sharded, it crashes or gives wrong logits. Keep both whole.
        tp_plan_overrides={
            "model.language_model.embed_tokens": "replicated_with_grad_allreduce",
            "lm_head": "replicated_with_grad_allreduce",
        },
    )
)

MINICPMV4_6 = register(
    FamilyAdapter(
        model_type="minicpmv4_6",
        display_name="MiniCPM-V 4.6",
        modalities=frozenset({"image", "video"}),
        media_towers=("model.vision_tower",),
        projectors=("model.merger",),
        tool_format="hermes_json",
        stop_tokens=("<|im_end|>",),
        # NOTE: a prompt's items sit side by side in one (1, 3, 14, W) tensor; two prompts'
        # tensors do not concatenate into anything its forward reads as two prompts.
        batched_media=False,
    )
)
