"""The Processor worker: a checkpoint's native processor behind AReno's one processor path.

A plain class, so Ray Serve (serving) and Ray actors (rollout) run the very same code.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from areno.media.decoder import DecodeOptions, MediaDecoder
from areno.media.types import DecodedMedia, MediaRef
from areno.models.registry import FamilyAdapter, adapter_for_checkpoint
from areno.processing.encode import PromptLimits, encode_prompt
from areno.processing.messages import (
    media_refs,
    to_template_messages,
    tools_as_dicts,
    validate_messages,
)
from areno.processing.turns import encode_continuation, extend_prompt, reply_text
from areno.processing.types import PromptInputs


class Processor:
    """Encodes chat messages (+ tools) and decoded media into `PromptInputs`."""

    def __init__(self, model_path: str | os.PathLike, *, limits: PromptLimits | None = None):
        from transformers import AutoProcessor

        self.model_path = str(model_path)
        self.adapter: FamilyAdapter = adapter_for_checkpoint(model_path)
        self.hf_processor = AutoProcessor.from_pretrained(self.model_path)
        self.limits = limits or PromptLimits()

    @property
    def tokenizer(self) -> Any:
        return self.hf_processor.tokenizer

    def decode_options(self, base: DecodeOptions | None = None) -> DecodeOptions:
        """Decoder options that match this processor (audio sampling rate, video audio tracks)."""
        base = base or DecodeOptions()
        extractor = getattr(self.hf_processor, "feature_extractor", None)
        rate = getattr(extractor, "sampling_rate", None) or base.audio_sampling_rate
        return dataclasses.replace(
            base, audio_sampling_rate=int(rate), video_with_audio=self.adapter.video_with_audio
        )

    def media_refs(self, messages: Sequence[Any]) -> list[MediaRef]:
        """The media the messages reference, after checking this family accepts each modality."""
        refs = media_refs(validate_messages(messages))
        for ref in refs:
            self.adapter.check_modality(ref.modality)
        return refs

    def encode(
        self,
        messages: Sequence[Any],
        media: Sequence[DecodedMedia],
        *,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: dict | None = None,
        max_new_tokens: int | None = None,
        add_generation_prompt: bool = True,
    ) -> PromptInputs:
        return encode_prompt(
            self.hf_processor,
            self.adapter,
            to_template_messages(validate_messages(messages)),
            media,
            tools=tools_as_dicts(tools),
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            limits=self.limits,
            max_new_tokens=max_new_tokens,
        )

    def encode_continuation(
        self,
        messages: Sequence[Any],
        media: Sequence[DecodedMedia],
        *,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
    ) -> PromptInputs:
        """The new messages of an episode (tool results...) encoded to follow a finished
        assistant turn; see `areno.processing.turns.encode_continuation`."""
        return encode_continuation(
            self.hf_processor,
            self.adapter,
            messages,
            media,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )

    def reply_text(
        self,
        content: str,
        tool_calls: Sequence[tuple[str, dict]] = (),
        *,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> str:
        """An assistant reply as this checkpoint generates it; see `turns.reply_text`."""
        return reply_text(
            self.hf_processor,
            self.adapter,
            content,
            tool_calls,
            tools=tools_as_dicts(tools),
            chat_template_kwargs=chat_template_kwargs,
        )

    def extend(
        self, prefix: PromptInputs, generated_ids: Sequence[int], delta: PromptInputs
    ) -> PromptInputs:
        """`prefix` + generated tokens + `delta` as one prompt; see `turns.extend_prompt`."""
        return extend_prompt(self.adapter, prefix, generated_ids, delta, self.tokenizer)


def process_messages(
    processor: Processor,
    decoder: MediaDecoder,
    messages: Sequence[Any],
    *,
    tools: Sequence[Any] | None = None,
    chat_template_kwargs: dict | None = None,
    max_new_tokens: int | None = None,
) -> PromptInputs:
    """Decode and encode in one process: the path rollout workers, tests and the demo take.

    Serving runs the same two steps in separate deployments (decoder, then processor).
    """
    messages = validate_messages(messages)
    media = decoder.decode_many(processor.media_refs(messages))
    return processor.encode(
        messages,
        media,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        max_new_tokens=max_new_tokens,
    )
