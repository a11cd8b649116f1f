"""`MediaDecoder`: the worker class that turns `MediaRef`s into decoded media, once per content.

It is a plain Python class; serving runs it as a Ray Serve deployment and rollout as a Ray actor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from areno.errors import ConfigError
from areno.media.decode import (
    DEFAULT_MAX_AUDIO_SECONDS,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_VIDEO_FRAME_PIXELS,
    decode_audio,
    decode_image,
    hash_bytes,
)
from areno.media.errors import UnsupportedMediaTypeError
from areno.media.sources import MediaBytes, MediaPolicy, load_media_bytes
from areno.media.types import MODALITIES, DecodedAudio, DecodedImage, DecodedMedia, MediaRef
from areno.media.video import decode_video


@dataclass(frozen=True)
class DecodeOptions:
    """How media is decoded; part of the cache key, so two settings never share an entry."""

    audio_sampling_rate: int = 16000
    video_fps: float = 2.0
    max_video_frames: int = 32
    video_with_audio: bool = False
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS
    max_video_frame_pixels: int = DEFAULT_MAX_VIDEO_FRAME_PIXELS

    def __post_init__(self) -> None:
        for name in ("audio_sampling_rate", "max_video_frames", "max_image_pixels"):
            _require_positive_int(name, getattr(self, name))
        _require_positive_int("max_video_frame_pixels", self.max_video_frame_pixels)
        for name in ("video_fps", "max_audio_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name} must be a number, got {value!r}", param=name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}", param=name)
        if not isinstance(self.video_with_audio, bool):
            raise ConfigError(f"video_with_audio must be a bool, got {self.video_with_audio!r}")

    def cache_key(self, modality: str) -> tuple:
        """Only the options that change this modality's result, so e.g. a new video fps does
        not evict cached images."""
        if modality == "image":
            return (self.max_image_pixels,)
        if modality == "audio":
            return (self.audio_sampling_rate, self.max_audio_seconds)
        audio = (self.audio_sampling_rate, self.max_audio_seconds) if self.video_with_audio else ()
        return (self.video_fps, self.max_video_frames, self.max_video_frame_pixels, *audio)


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}", param=name)


class MediaDecoder:
    """Loads and decodes media under a `MediaPolicy`, with a bounded LRU cache of results.

    NOTE: media is decoded once. The cache key is (sha256 of the bytes, modality, the options
    that matter), so the same content from any URL is decoded once per setting. A hit returns
    the very same object: callers must treat decoded media as read-only.
    """

    def __init__(
        self,
        policy: MediaPolicy,
        options: DecodeOptions | None = None,
        *,
        max_cache_entries: int = 64,
        max_cache_bytes: int = 1 << 30,
    ) -> None:
        self.policy = policy
        self.options = options or DecodeOptions()
        self.max_cache_entries = max_cache_entries
        self.max_cache_bytes = max_cache_bytes
        self._init_cache()

    def _init_cache(self) -> None:
        self._cache: OrderedDict[tuple, tuple[DecodedMedia, int]] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()  # Serve replicas may call from several threads
        self.num_hits = 0
        self.num_misses = 0

    # Ray pickles the instance to ship it; locks do not pickle and a cache is not worth shipping.
    def __getstate__(self) -> dict:
        return {
            k: v for k, v in self.__dict__.items() if k not in ("_cache", "_lock", "_cache_bytes")
        }

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_cache()

    def decode(self, ref: MediaRef, **overrides: Any) -> DecodedMedia:
        """Load and decode one item. `overrides` replace `DecodeOptions` fields for this call
        (e.g. a per-request `video_fps=1.0`)."""
        if ref.modality not in MODALITIES:
            raise UnsupportedMediaTypeError(
                f"unknown modality {ref.modality!r}; expected one of {list(MODALITIES)}"
            )
        options = self._options_for({**self._request_overrides(ref), **overrides})
        raw = load_media_bytes(ref.url, self.policy, expected_modality=ref.modality)
        digest = hash_bytes(raw.data)
        key = (digest, ref.modality, options.cache_key(ref.modality))
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return entry[0]
            self.num_misses += 1
        decoded = _decode_bytes(ref.modality, raw, item_hash(*key), options)
        self._store(key, decoded)
        return decoded

    def decode_many(self, refs: list[MediaRef], **overrides: Any) -> list[DecodedMedia]:
        """Decode `refs` in order; repeated content within the list is decoded once."""
        return [self.decode(ref, **overrides) for ref in refs]

    def cache_info(self) -> dict[str, int]:
        """Hit / miss counters and the cache's current size."""
        with self._lock:
            return {
                "num_hits": self.num_hits,
                "num_misses": self.num_misses,
                "num_entries": len(self._cache),
                "num_bytes": self._cache_bytes,
            }

    def _request_overrides(self, ref: MediaRef) -> dict[str, Any]:
        """A content part's own sampling options (`video_url.fps` / `max_frames`).

        NOTE: a request may lower the frame cap, never raise it above the server's.
        """
        if ref.modality != "video" or not ref.options:
            return {}
        out: dict[str, Any] = {}
        if ref.options.get("fps") is not None:
            out["video_fps"] = float(ref.options["fps"])
        if ref.options.get("max_frames") is not None:
            out["max_video_frames"] = min(
                int(ref.options["max_frames"]), self.options.max_video_frames
            )
        return out

    def _options_for(self, overrides: dict[str, Any]) -> DecodeOptions:
        if not overrides:
            return self.options
        try:
            return dataclasses.replace(self.options, **overrides)
        except TypeError as exc:  # an unknown field name
            raise ConfigError(f"invalid decode option override: {exc}") from None

    def _store(self, key: tuple, decoded: DecodedMedia) -> None:
        num_bytes = _approx_nbytes(decoded)
        if num_bytes > self.max_cache_bytes or self.max_cache_entries < 1:
            return
        with self._lock:
            if key in self._cache:  # another thread decoded it meanwhile
                return
            self._cache[key] = (decoded, num_bytes)
            self._cache_bytes += num_bytes
            while (
                len(self._cache) > self.max_cache_entries
                or self._cache_bytes > self.max_cache_bytes
            ):
                _, (_, evicted_bytes) = self._cache.popitem(last=False)
                self._cache_bytes -= evicted_bytes


def item_hash(source_hash: str, modality: str, options: tuple) -> str:
    """The hash that names a decoded item wherever it is reused (processor outputs, tower
    features, the KV blocks that hold them): its source bytes' sha256 with the modality and
    every decoding option that shaped it (`DecodeOptions.cache_key`). The same clip at 1 and
    at 2 fps is two items, even where both decode to as many frames."""
    return hashlib.sha256(f"{source_hash}|{modality}|{options!r}".encode()).hexdigest()


def _decode_bytes(
    modality: str, raw: MediaBytes, digest: str, options: DecodeOptions
) -> DecodedMedia:
    if modality == "image":
        return decode_image(
            raw.data, raw.source, max_pixels=options.max_image_pixels, content_hash=digest
        )
    if modality == "audio":
        return decode_audio(
            raw.data,
            raw.source,
            sampling_rate=options.audio_sampling_rate,
            max_seconds=options.max_audio_seconds,
            content_hash=digest,
        )
    return decode_video(
        raw.data,
        raw.source,
        fps=options.video_fps,
        max_frames=options.max_video_frames,
        with_audio=options.video_with_audio,
        audio_sampling_rate=options.audio_sampling_rate,
        max_frame_pixels=options.max_video_frame_pixels,
        max_audio_seconds=options.max_audio_seconds,
        content_hash=digest,
    )


def _approx_nbytes(decoded: DecodedMedia) -> int:
    if isinstance(decoded, DecodedImage):
        width, height = decoded.image.size
        return width * height * 3
    if isinstance(decoded, DecodedAudio):
        return decoded.waveform.nbytes
    audio = decoded.audio.waveform.nbytes if decoded.audio is not None else 0
    return decoded.frames.nbytes + audio
