"""The media layer: where media bytes come from (and who may read them), and how they decode.

`MediaDecoder` is the worker class; `load_media_bytes` and the `decode_*` functions are the
pieces it is built from, usable on their own.
"""

from __future__ import annotations

from areno.media.decode import decode_audio, decode_image, hash_bytes
from areno.media.decoder import DecodeOptions, MediaDecoder
from areno.media.errors import (
    InvalidMediaURLError,
    MediaAccessDeniedError,
    MediaDecodeError,
    MediaError,
    MediaFetchError,
    MediaNotFoundError,
    MediaTooLargeError,
    MissingFrameRateError,
    UnsupportedMediaTypeError,
)
from areno.media.sources import MediaBytes, MediaPolicy, is_loopback_host, load_media_bytes
from areno.media.types import (
    MODALITIES,
    DecodedAudio,
    DecodedImage,
    DecodedMedia,
    DecodedVideo,
    MediaRef,
    Modality,
)
from areno.media.video import decode_video, sample_frame_indices

__all__ = [
    "MODALITIES",
    "DecodeOptions",
    "DecodedAudio",
    "DecodedImage",
    "DecodedMedia",
    "DecodedVideo",
    "InvalidMediaURLError",
    "MediaAccessDeniedError",
    "MediaBytes",
    "MediaDecodeError",
    "MediaDecoder",
    "MediaError",
    "MediaFetchError",
    "MediaNotFoundError",
    "MediaPolicy",
    "MediaRef",
    "MediaTooLargeError",
    "MissingFrameRateError",
    "Modality",
    "UnsupportedMediaTypeError",
    "decode_audio",
    "decode_image",
    "decode_video",
    "hash_bytes",
    "is_loopback_host",
    "load_media_bytes",
    "sample_frame_indices",
]
