"""Start-up prompts that carry one small synthetic item of each modality a family accepts.

The first request of a modality pays for first use: the media tower's first forward (on a GPU its
kernels load and its libraries plan their calls) and the native processor's first call. On an H200
a 2B Qwen3.5's first image request took 1.2 s against 0.13 s for the next ones. A server runs these
prompts before it says it is ready, so that cost lands in its start-up, and a tower that cannot
run fails there, naming the modality, instead of in a user's request.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from areno.errors import PromptTooLongError
from areno.media.types import DecodedAudio, DecodedImage, DecodedMedia, DecodedVideo
from areno.processing.processor import Processor
from areno.processing.types import PromptInputs

SIDE = 64  # pixels of the synthetic image and video frames
VIDEO_FPS = 2.0
VIDEO_FRAMES = 4
AUDIO_SECONDS = 1.0


def synthetic_media(
    modality: str, audio_sampling_rate: int, video_with_audio: bool
) -> DecodedMedia:
    """A small decoded item of `modality`: a gray image, a quiet tone, a few gray frames."""
    source, digest = f"start-up {modality}", f"start-up-{modality}"  # never a sha256
    if modality == "image":
        return DecodedImage(Image.new("RGB", (SIDE, SIDE), (128, 128, 128)), digest, source)
    samples = int(AUDIO_SECONDS * audio_sampling_rate)
    t = np.arange(samples, dtype=np.float32) / audio_sampling_rate
    audio = DecodedAudio(
        (0.1 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32),
        audio_sampling_rate,
        "start-up-audio",
        source,
    )
    if modality == "audio":
        return audio
    if modality == "video":
        frames = np.full((VIDEO_FRAMES, SIDE, SIDE, 3), 128, dtype=np.uint8)
        return DecodedVideo(
            frames=frames,
            fps=VIDEO_FPS,
            frame_indices=list(range(VIDEO_FRAMES)),
            total_num_frames=VIDEO_FRAMES,
            duration_s=VIDEO_FRAMES / VIDEO_FPS,
            content_hash=digest,
            source=source,
            audio=audio if video_with_audio else None,
        )
    raise ValueError(f"no synthetic media for modality {modality!r}")


def warm_up_prompts(processor: Processor) -> dict[str, PromptInputs]:
    """One encoded prompt per modality the processor's family accepts, in a fixed order. A
    modality whose prompt is over the processor's limits is left out: a request like it would be
    refused anyway."""
    options = processor.decode_options()
    prompts = {}
    for modality in sorted(processor.adapter.modalities):
        media = synthetic_media(modality, options.audio_sampling_rate, options.video_with_audio)
        part = {"type": f"{modality}_url", f"{modality}_url": {"url": f"start-up.{modality}"}}
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}]
        try:
            prompts[modality] = processor.encode(messages, [media])
        except PromptTooLongError:
            continue
    return prompts
