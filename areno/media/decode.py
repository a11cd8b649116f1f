"""Bytes → decoded media: images with Pillow, audio with soundfile / PyAV, video with PyAV.

Every limit is checked on declared sizes before anything big is allocated, and every library
failure on bad bytes becomes a `MediaDecodeError` that names the container and codec.
"""

from __future__ import annotations

import functools
import hashlib
import io
from collections.abc import Iterator
from contextlib import contextmanager

import av
import numpy as np
import soundfile as sf
from PIL import Image, ImageOps

from areno.media.errors import (
    MediaError,
    MediaTooLargeError,
    decode_error,
)
from areno.media.types import DecodedAudio, DecodedImage

DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192  # ~67 M pixels, ~200 MB as RGB
DEFAULT_MAX_AUDIO_SECONDS = 20 * 60.0
DEFAULT_MAX_VIDEO_FRAME_PIXELS = 4096 * 4096
# Above this a "frame rate" is a container tick rate (Matroska reports 1000 when it knows none).
MAX_PLAUSIBLE_FPS = 480.0
_RESAMPLE_CHUNK = 1 << 16
_NO_NESTED_PROTOCOLS = {"protocol_whitelist": "none"}
# Formats people send; the allowlist keeps Pillow's exotic plugins (EPS runs Ghostscript) unused.
_WANTED_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "ICO", "AVIF", "JPEG2000")
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
_HIGH_DEPTH_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def hash_bytes(data: bytes) -> str:
    """The key decoded media is cached under: sha256 hex of the source bytes."""
    return hashlib.sha256(data).hexdigest()


@contextmanager
def library_errors(what: str, source: str, found: dict[str, str]) -> Iterator[None]:
    """Turn any library exception on bad bytes into a `MediaDecodeError`.

    Pillow, libsndfile and FFmpeg raise a wide, version-dependent set of types on malformed input
    (OSError, ValueError, SyntaxError, struct.error, EOFError, IndexError, av.error.*...), so the
    only reliable way to keep "bad input → clear 4xx" is to catch broadly at this boundary.
    """
    try:
        yield
    except MediaError:
        raise
    except Exception as exc:  # noqa: BLE001 - see docstring
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise decode_error(
            what, source, reason[:300], container=found.get("container"), codec=found.get("codec")
        ) from exc


def too_large(
    source: str, what: str, value: float, limit: float, option: str
) -> MediaTooLargeError:
    """A `MediaTooLargeError` naming the value, the limit and the option that sets it."""
    return MediaTooLargeError(
        f"{source}: {what} is {_number(value)}, over the limit of {_number(limit)} ({option}); "
        f"send a smaller file or raise {option}"
    )


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.2f}"


# --- images -----------------------------------------------------------------------------------


@functools.cache
def image_formats() -> tuple[str, ...]:
    """The Pillow formats decode_image accepts (AVIF / JPEG 2000 only where Pillow has them)."""
    Image.init()
    return tuple(f for f in _WANTED_IMAGE_FORMATS if f in Image.OPEN)


def decode_image(
    data: bytes,
    source: str,
    *,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    content_hash: str | None = None,
) -> DecodedImage:
    """Decode an image to RGB with EXIF orientation applied (first frame of animations)."""
    found: dict[str, str] = {}
    if not data:
        raise decode_error("an image", source, "the file is empty (0 bytes)")
    with library_errors("an image", source, found):
        try:
            # Image.open only reads the header, so the size check below runs before decoding.
            opened = Image.open(io.BytesIO(data), formats=image_formats())
        except Image.UnidentifiedImageError:
            reason = f"not a recognised image format (supported: {', '.join(image_formats())})"
            raise decode_error("an image", source, reason) from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise MediaTooLargeError(
                f"{source}: image is too large ({exc}); the limit is {max_pixels} pixels "
                "(max_image_pixels)"
            ) from None
        with opened:
            found["container"] = opened.format or "unknown"
            width, height = opened.size
            if width * height > max_pixels:
                raise too_large(
                    source, f"the image size {width}x{height} in pixels", width * height,
                    max_pixels, "max_image_pixels",
                )  # fmt: skip
            opened.load()
            image = _to_rgb(ImageOps.exif_transpose(opened))
    return DecodedImage(image=image, content_hash=content_hash or hash_bytes(data), source=source)


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB uint8; transparency is composited on white (what HF image processors assume)."""
    if image.mode == "RGB":
        return image
    if image.mode in _HIGH_DEPTH_MODES:
        # Pillow's own I;16 → RGB conversion clips at 255 instead of scaling.
        values = np.clip(np.asarray(image, dtype=np.int64), 0, 65535) // 257
        return Image.fromarray(values.astype(np.uint8)).convert("RGB")
    if image.mode == "F":
        values = np.nan_to_num(np.asarray(image, dtype=np.float32))
        scale = 255.0 if values.max(initial=0.0) <= 1.0 else 1.0
        return Image.fromarray(np.clip(values * scale, 0, 255).astype(np.uint8)).convert("RGB")
    if image.mode in _ALPHA_MODES or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


# --- audio ------------------------------------------------------------------------------------


def decode_audio(
    data: bytes,
    source: str,
    *,
    sampling_rate: int,
    max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
    content_hash: str | None = None,
) -> DecodedAudio:
    """Decode audio to float32 mono at exactly `sampling_rate`.

    libsndfile handles WAV/FLAC/OGG/MP3 with exact frame counts; anything it does not recognise
    (m4a/aac, opus, webm...) goes to FFmpeg through PyAV.
    """
    found: dict[str, str] = {}
    with library_errors("audio", source, found):
        decoded = _read_soundfile(data, source, max_seconds, found)
        if decoded is not None:
            waveform = _resample_mono(*decoded, sampling_rate)
        else:
            with open_container(data, "audio", source, found) as container:
                stream = next((s for s in container.streams if s.type == "audio"), None)
                if stream is None:
                    raise decode_error(
                        "audio",
                        source,
                        "the file has no audio stream",
                        container=found["container"],
                    )
                found["codec"] = stream.codec_context.name
                waveform = decode_av_audio(container, stream, source, sampling_rate, max_seconds)
    if waveform.size == 0:
        raise decode_error(
            "audio",
            source,
            "the file contains no samples (zero-length audio)",
            **found_names(found),
        )
    return DecodedAudio(
        waveform=waveform,
        sampling_rate=sampling_rate,
        content_hash=content_hash or hash_bytes(data),
        source=source,
    )


def found_names(found: dict[str, str]) -> dict[str, str | None]:
    """The container / codec names recorded so far, as `decode_error` keyword arguments."""
    return {"container": found.get("container"), "codec": found.get("codec")}


def _read_soundfile(
    data: bytes, source: str, max_seconds: float, found: dict[str, str]
) -> tuple[np.ndarray, int] | None:
    """(mono float32, rate) via libsndfile, or None when it does not recognise the format."""
    try:
        handle = sf.SoundFile(io.BytesIO(data))
    except (sf.SoundFileError, RuntimeError, TypeError):
        return None
    with handle:
        found.update(container=handle.format, codec=handle.subtype)
        # NOTE: checked on the declared frame count, before `read` allocates it.
        seconds = handle.frames / handle.samplerate
        if seconds > max_seconds:
            raise too_large(
                source, "the duration in seconds", seconds, max_seconds, "max_audio_seconds"
            )
        samples = handle.read(dtype="float32", always_2d=True)
        return samples.mean(axis=1, dtype=np.float32), handle.samplerate


def _resample_mono(mono: np.ndarray, rate: int, target: int) -> np.ndarray:
    if rate == target or mono.size == 0:
        return np.ascontiguousarray(mono, dtype=np.float32)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target)
    out: list[np.ndarray] = []
    for start in range(0, mono.size, _RESAMPLE_CHUNK):
        chunk = np.ascontiguousarray(mono[None, start : start + _RESAMPLE_CHUNK])
        frame = av.AudioFrame.from_ndarray(chunk, format="flt", layout="mono")
        frame.sample_rate = rate
        out.extend(o.to_ndarray()[0] for o in resampler.resample(frame))
    out.extend(o.to_ndarray()[0] for o in resampler.resample(None))  # flush the filter delay
    # NOTE: a clip shorter than one output sample (a few frames at an absurd declared rate)
    # resamples to nothing; decode_audio reports it as zero-length audio.
    return np.concatenate(out).astype(np.float32, copy=False) if out else np.zeros(0, np.float32)


def decode_av_audio(
    container: av.container.InputContainer,
    stream: av.audio.stream.AudioStream,
    source: str,
    sampling_rate: int,
    max_seconds: float,
) -> np.ndarray:
    """Decode one PyAV audio stream to mono float32 at `sampling_rate`, capped in duration."""
    declared = _declared_seconds(container, stream)
    if declared is not None and declared > max_seconds:
        raise too_large(
            source, "the duration in seconds", declared, max_seconds, "max_audio_seconds"
        )
    # Declared durations can lie or be missing, so the cap is enforced while decoding too.
    max_samples = int(max_seconds * sampling_rate) + 1
    # Keep the channel layout and downmix by averaging ourselves: swresample's own downmix
    # gains differ per layout, which would make the same sound louder from m4a than from WAV.
    resampler = av.AudioResampler(format="fltp", rate=sampling_rate)
    out: list[np.ndarray] = []
    num_samples = 0
    for frame in container.decode(stream):
        for resampled in resampler.resample(frame):
            out.append(resampled.to_ndarray().mean(axis=0, dtype=np.float32))
            num_samples += resampled.samples
        if num_samples > max_samples:
            seconds = num_samples / sampling_rate
            raise too_large(
                source, "the duration in seconds", seconds, max_seconds, "max_audio_seconds"
            )
    out.extend(o.to_ndarray().mean(axis=0, dtype=np.float32) for o in resampler.resample(None))
    return np.concatenate(out).astype(np.float32, copy=False) if out else np.zeros(0, np.float32)


def _declared_seconds(
    container: av.container.InputContainer, stream: av.stream.Stream
) -> float | None:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / av.time_base
    return None


@contextmanager
def open_container(
    data: bytes, what: str, source: str, found: dict[str, str]
) -> Iterator[av.container.InputContainer]:
    """Open `data` with PyAV, recording the container format name in `found`."""
    if not data:
        raise decode_error(what, source, "the file is empty (0 bytes)")
    try:
        # NOTE: no protocol may be opened from inside a container. Otherwise an ffconcat or HLS
        # playlist sent as "video" makes FFmpeg read files or URLs that MediaPolicy never saw.
        container = av.open(io.BytesIO(data), mode="r", options=_NO_NESTED_PROTOCOLS)
    except av.error.FFmpegError as exc:
        raise decode_error(
            what,
            source,
            f"FFmpeg cannot open it ({exc.strerror}): it is corrupt, truncated or not a media file",
        ) from None
    with container:
        found["container"] = container.format.name
        yield container
