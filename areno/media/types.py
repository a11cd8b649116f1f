"""What the media layer hands to the processor: decoded media, one object per content part."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from PIL import Image

Modality = Literal["image", "audio", "video"]
MODALITIES: tuple[Modality, ...] = ("image", "audio", "video")


@dataclass(frozen=True)
class MediaRef:
    """A reference to one media item, as a message content part names it.

    `url` is a local path (absolute or relative), `file://`, `data:` or `http(s)://` URL. The
    OpenAI `input_audio` form is turned into a `data:` URL before it gets here.
    """

    modality: Modality
    url: str
    # Per-item decode options from the request (a video part's fps / max_frames).
    options: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass
class DecodedImage:
    image: Image.Image  # RGB, EXIF orientation applied
    # the item's name wherever it is reused: its source bytes' sha256, and where a MediaDecoder
    # decoded it, with every option that shaped it (areno/media/decoder.py::item_hash)
    content_hash: str
    source: str  # a short description of where it came from, for messages (never the bytes)
    modality: Modality = field(default="image", init=False)


@dataclass
class DecodedAudio:
    waveform: np.ndarray  # float32, mono, shape (num_samples,)
    sampling_rate: int
    content_hash: str
    source: str
    modality: Modality = field(default="audio", init=False)

    @property
    def duration_s(self) -> float:
        return len(self.waveform) / self.sampling_rate


@dataclass
class DecodedVideo:
    frames: np.ndarray  # uint8, (num_frames, height, width, 3): the SAMPLED frames only
    fps: float  # the stream's real frame rate
    frame_indices: list[int]  # index of each sampled frame in the full stream
    total_num_frames: int  # frames in the full stream
    duration_s: float
    content_hash: str
    source: str
    audio: DecodedAudio | None = None  # the audio track, when asked for and present
    modality: Modality = field(default="video", init=False)

    @property
    def timestamps_s(self) -> list[float]:
        return [i / self.fps for i in self.frame_indices]


DecodedMedia = DecodedImage | DecodedAudio | DecodedVideo
