"""The one processor path: messages + decoded media -> PromptInputs, for serving and training alike."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from areno.errors import ArenoError, PromptTooLongError, UnsupportedModalityError
from areno.media.errors import MediaError
from areno.media.types import DecodedAudio, DecodedImage, DecodedMedia, DecodedVideo
from areno.models.registry import FamilyAdapter
from areno.processing.types import MediaSpan, PromptInputs
from areno.protocol.errors import RequestValidationError

# Processor outputs that describe the text, not model inputs.
_TEXT_KEYS = {"input_ids", "attention_mask", "offset_mapping", "text_replacement_offsets"}


class MediaMismatchError(ArenoError):
    """The decoded media do not match the placeholders the messages render."""

    code = "media_mismatch"


class UnprocessableMediaError(ArenoError):
    """The checkpoint's own processor refused a decoded media item (e.g. an image whose aspect
    ratio its family cannot patch)."""

    code = "unprocessable_media"


# What a prompt's own content can get wrong: media that is missing, refused or undecodable, a
# modality the model does not take, a prompt over the limits, a malformed message. A GRPO
# rollout skips such a sample's group and `areno sft` the sample (the error says why); any
# other error is a bug or a configuration and fails the run.
SAMPLE_ERRORS = (
    MediaError,
    MediaMismatchError,
    PromptTooLongError,
    RequestValidationError,
    UnprocessableMediaError,
    UnsupportedModalityError,
)


def sample_error_text(error: Exception) -> str:
    """How a skipped sample's error is reported: "MediaNotFoundError: media file not found..."."""
    return f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class PromptLimits:
    """--max-prompt-tokens and --max-context-len, checked on the ENCODED prompt length."""

    max_prompt_tokens: int | None = None
    max_context_len: int | None = None

    def check(self, num_prompt_tokens: int, max_new_tokens: int | None = None) -> None:
        n = num_prompt_tokens
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            raise PromptTooLongError(
                f"the prompt encodes to {n} tokens (media placeholders included), over "
                f"--max-prompt-tokens={self.max_prompt_tokens}; shorten the text, send fewer or "
                f"smaller media items, or lower the video fps / max frames"
            )
        if self.max_context_len is None:
            return
        if n >= self.max_context_len:
            raise PromptTooLongError(
                f"the prompt encodes to {n} tokens (media placeholders included), which leaves no "
                f"room to generate within --max-context-len={self.max_context_len}"
            )
        if max_new_tokens is not None and n + max_new_tokens > self.max_context_len:
            raise PromptTooLongError(
                f"this model's context is {self.max_context_len} tokens, but {n + max_new_tokens} "
                f"were requested ({n} in the encoded prompt, {max_new_tokens} to generate); "
                f"lower max_tokens to at most {self.max_context_len - n}"
            )


def _expand_video_audio(
    template_messages: list[dict], media: list[DecodedMedia]
) -> list[DecodedMedia]:
    """Give each video's audio track its own audio item right after the video (in place)."""
    items = iter(media)
    expanded: list[DecodedMedia] = []
    for message in template_messages:
        if not isinstance(message["content"], list):
            continue
        parts: list[dict] = []
        for part in message["content"]:
            parts.append(part)
            if part["type"] == "text":
                continue
            item = next(items)
            expanded.append(item)
            if isinstance(item, DecodedVideo) and item.audio is not None:
                parts.append({"type": "audio"})
                expanded.append(item.audio)
        message["content"] = parts
    return expanded


def _with_min_frames(video: DecodedVideo, min_frames: int) -> tuple[np.ndarray, list[int]]:
    """The sampled frames and their indices, the last one repeated up to `min_frames`, as
    qwen-vl-utils samples a short clip: a video processor with a temporal patch of 2 frames
    (Qwen's) refuses a clip sampled down to one."""
    pad = min_frames - len(video.frame_indices)
    if pad <= 0:
        return video.frames, list(video.frame_indices)
    frames = np.concatenate([video.frames, np.repeat(video.frames[-1:], pad, axis=0)])
    return frames, [*video.frame_indices, *[video.frame_indices[-1]] * pad]


def _processor_call_kwargs(
    adapter: FamilyAdapter, media: list[DecodedMedia], min_video_frames: int = 1
) -> dict:
    images = [m.image for m in media if isinstance(m, DecodedImage)]
    audios = [m.waveform for m in media if isinstance(m, DecodedAudio)]
    videos = [m for m in media if isinstance(m, DecodedVideo)]
    kwargs: dict[str, Any] = {}
    if images:
        kwargs["images"] = images
        kwargs["images_kwargs"] = dict(adapter.processor_kwargs.get("images_kwargs", {}))
    if audios:
        kwargs["audio"] = audios
        rate = next(m.sampling_rate for m in media if isinstance(m, DecodedAudio))
        kwargs["audio_kwargs"] = {"sampling_rate": rate} | adapter.processor_kwargs.get(
            "audio_kwargs", {}
        )
    if videos:
        from transformers.video_utils import VideoMetadata

        sampled = [_with_min_frames(v, min_video_frames) for v in videos]
        kwargs["videos"] = [frames for frames, _ in sampled]
        metadata = [
            VideoMetadata(
                total_num_frames=v.total_num_frames,
                fps=v.fps,
                duration=v.duration_s,
                frames_indices=indices,
                height=int(v.frames.shape[1]),
                width=int(v.frames.shape[2]),
                video_backend="pyav",
            )
            for v, (_, indices) in zip(videos, sampled, strict=True)
        ]
        # NOTE: frames were already sampled by the decoder (target fps / max frames); the real
        # fps and frame indices give the processor correct timestamps.
        kwargs["videos_kwargs"] = {"video_metadata": metadata, "do_sample_frames": False} | (
            adapter.processor_kwargs.get("videos_kwargs", {})
        )
    return kwargs


def _spans(
    out: dict, media: list[DecodedMedia], placeholder_ids: dict[str, int]
) -> list[MediaSpan]:
    """Token spans per media item, from the processor's own replacement offsets."""
    token_starts = out["offset_mapping"][0, :, 0].tolist()
    input_ids = out["input_ids"][0].tolist()
    replacements = out.get("text_replacement_offsets") or [[]]
    replacements = replacements[0]
    if len(replacements) != len(media):
        raise MediaMismatchError(
            f"the processor expanded {len(replacements)} media placeholders but the messages "
            f"carry {len(media)} media items"
        )
    spans = []
    for index, (rep, item) in enumerate(zip(replacements, media, strict=True)):
        char_start, char_end = rep["new_span"]
        start = bisect.bisect_left(token_starts, char_start)
        end = bisect.bisect_left(token_starts, char_end)
        token_id = placeholder_ids[rep["type"]]
        count = sum(1 for t in input_ids[start:end] if t == token_id)
        spans.append(MediaSpan(rep["type"], index, start, end, count, item.content_hash))
    return spans


def placeholder_token_ids(hf_processor: Any) -> dict[str, int]:
    """The id of each modality's placeholder token, as the family's processor names it."""
    ids = {}
    for modality in ("image", "audio", "video"):
        token_id = getattr(hf_processor, f"{modality}_token_id", None)
        if token_id is not None:
            ids[modality] = int(token_id)
    return ids


def _tool_media_dropped(hf_processor: Any, modality: str, chat_template_kwargs: dict) -> bool:
    """Whether the chat template drops `modality` parts inside tool messages (renders nothing)."""
    probe = [
        {"role": "user", "content": "probe"},
        {"role": "assistant", "content": "probe"},
        {"role": "tool", "tool_call_id": "probe", "content": [{"type": modality}]},
    ]
    empty = [*probe[:2], {**probe[2], "content": []}]
    render = hf_processor.apply_chat_template
    kwargs = {"tokenize": False, "add_generation_prompt": False, **chat_template_kwargs}
    return render(probe, **kwargs) == render(empty, **kwargs)


def _move_tool_media(
    hf_processor: Any, messages: list[dict], chat_template_kwargs: dict
) -> list[dict]:
    """Move media out of tool messages whose template drops it, into a user message right after
    the run of consecutive tool messages (media order is kept)."""
    modalities = {
        part["type"]
        for m in messages
        if m["role"] == "tool" and isinstance(m["content"], list)
        for part in m["content"]
        if part["type"] != "text"
    }
    dropped = {m for m in modalities if _tool_media_dropped(hf_processor, m, chat_template_kwargs)}
    if not dropped:
        return messages
    out: list[dict] = []
    moved: list[dict] = []
    for i, message in enumerate(messages):
        content = message["content"]
        is_tool = message["role"] == "tool" and isinstance(content, list)
        if is_tool and any(part["type"] in dropped for part in content):
            # Move every media part of the message, so the media order stays the order the
            # decoded items arrive in.
            moved += [part for part in content if part["type"] != "text"]
            message = {**message, "content": [p for p in content if p["type"] == "text"]}
        out.append(message)
        next_is_tool = i + 1 < len(messages) and messages[i + 1]["role"] == "tool"
        if moved and not next_is_tool:
            out.append({"role": "user", "content": moved})
            moved = []
    return out


def prepare_messages(
    hf_processor: Any,
    adapter: FamilyAdapter,
    template_messages: list[dict],
    media: Sequence[DecodedMedia],
    chat_template_kwargs: dict | None = None,
) -> tuple[list[dict], list[DecodedMedia]]:
    """Template messages and media as the processor takes them (copies; inputs are untouched).

    Tool-message media that the template would drop moves into a user message after the tool
    results; a video's audio track becomes its own item; every modality is checked.
    """
    messages = [dict(m) for m in template_messages]
    messages = _move_tool_media(hf_processor, messages, chat_template_kwargs or {})
    media = list(media)
    if adapter.video_with_audio and "audio" in adapter.modalities:
        media = _expand_video_audio(messages, media)
    for item in media:
        adapter.check_modality(item.modality)
    return messages, media


def run_processor(
    hf_processor: Any, adapter: FamilyAdapter, text: str, media: list[DecodedMedia]
) -> PromptInputs:
    """THE native processor call: rendered template text + decoded media -> PromptInputs.

    `media` holds the items in placeholder order (after `prepare_messages`); spans are relative
    to `text`'s tokens. Special tokens are never added: the template writes them.
    """
    video_processor = getattr(hf_processor, "video_processor", None)
    min_video_frames = getattr(video_processor, "temporal_patch_size", None) or 1
    try:
        out = hf_processor(
            text=[text],
            return_tensors="pt",
            return_offsets_mapping=True,
            return_text_replacement_offsets=True,
            add_special_tokens=False,
            **_processor_call_kwargs(adapter, media, min_video_frames),
        )
    except ValueError as exc:  # the family's own checks on media sizes and shapes
        sources = ", ".join(item.source for item in media[:4]) + (", ..." if media[4:] else "")
        raise UnprocessableMediaError(
            f"the {adapter.display_name} processor cannot take the media of this request "
            f"({sources}): {exc}"
        ) from None
    input_ids = out["input_ids"][0].tolist()
    spans = _spans(out, media, placeholder_token_ids(hf_processor)) if media else []
    mm_inputs = {k: v for k, v in out.items() if k not in _TEXT_KEYS}
    return PromptInputs(input_ids=input_ids, mm_inputs=mm_inputs, mm_spans=spans, prompt_text=text)


def encode_prompt(
    hf_processor: Any,
    adapter: FamilyAdapter,
    template_messages: list[dict],
    media: Sequence[DecodedMedia],
    *,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
    limits: PromptLimits | None = None,
    max_new_tokens: int | None = None,
) -> PromptInputs:
    """Render the checkpoint's chat template and run its native processor on the media.

    `template_messages` come from `to_template_messages` (media parts as bare placeholders);
    `media` holds the decoded items in the same order. Raises PromptTooLongError when the encoded
    length breaks `limits`.
    """
    messages, media = prepare_messages(
        hf_processor, adapter, template_messages, media, chat_template_kwargs
    )
    text = hf_processor.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **(chat_template_kwargs or {}),
    )
    inputs = run_processor(hf_processor, adapter, text, media)
    (limits or PromptLimits()).check(inputs.num_prompt_tokens, max_new_tokens)
    return inputs
