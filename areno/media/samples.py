"""Real media files for tests, the demo and benchmarks, deterministic by seed.

Each writer picks the format from the file suffix and returns the path. Content is simple but not
constant (gradients, a moving square, tones with harmonics), so decoders and models see real data.
"""

from __future__ import annotations

import fractions
import os
from pathlib import Path
from typing import Any

import av
import numpy as np
import soundfile as sf
from PIL import Image

_IMAGE_FORMATS = {
    ".png": "PNG",
    ".jpg": "JPEG",
    ".jpeg": "JPEG",
    ".webp": "WEBP",
    ".gif": "GIF",
    ".bmp": "BMP",
}
_SOUNDFILE_FORMATS = {".wav": "WAV", ".flac": "FLAC", ".ogg": "OGG", ".mp3": "MP3"}
# Suffix → (PyAV container format, audio codec) for formats libsndfile cannot write.
_AV_AUDIO_FORMATS = {
    ".m4a": ("mp4", "aac"),
    ".opus": ("ogg", "libopus"),
    ".webm": ("webm", "libopus"),
}
_EXIF_ORIENTATION = 0x0112


def image_array(width: int, height: int, *, seed: int = 0, frame: int = 0) -> np.ndarray:
    """An RGB uint8 `(height, width, 3)` picture: gradients plus a square that moves per frame."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=3)
    ys, xs = np.mgrid[0:height, 0:width]
    rgb = np.stack(
        [
            (xs * 255 // max(width - 1, 1) + base[0]) % 256,
            (ys * 255 // max(height - 1, 1) + base[1]) % 256,
            ((xs + ys + frame * 16) * 4 + base[2]) % 256,
        ],
        axis=-1,
    ).astype(np.uint8)
    side = max(2, min(width, height) // 4)
    x0 = (frame * 7 + int(rng.integers(0, width))) % max(width - side, 1)
    y0 = (frame * 3 + int(rng.integers(0, height))) % max(height - side, 1)
    rgb[y0 : y0 + side, x0 : x0 + side] = 255 - base.astype(np.uint8)
    return rgb


def write_image(
    path: str | os.PathLike,
    width: int = 64,
    height: int = 48,
    *,
    seed: int = 0,
    mode: str = "RGB",
    orientation: int | None = None,
) -> Path:
    """Write an image (.png .jpg/.jpeg .webp .gif .bmp) in Pillow `mode` (RGB, RGBA, L, P...),
    with an EXIF orientation tag (1-8) when `orientation` is given (JPEG, PNG, WEBP)."""
    path = Path(path)
    fmt = _suffix_format(path, _IMAGE_FORMATS)
    image = Image.fromarray(image_array(width, height, seed=seed))
    if mode == "RGBA":
        alpha = np.linspace(0, 255, width * height, dtype=np.uint8).reshape(height, width)
        image.putalpha(Image.fromarray(alpha))
    elif mode == "P":
        image = image.quantize(colors=16)
    elif mode != "RGB":
        image = image.convert(mode)
    kwargs = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[_EXIF_ORIENTATION] = orientation
        kwargs["exif"] = exif.tobytes()
    image.save(path, format=fmt, **kwargs)
    return path


def tone(
    seconds: float, sampling_rate: int, *, channels: int = 1, freq: float = 440.0, seed: int = 0
) -> np.ndarray:
    """A float32 `(num_samples, channels)` tone with a harmonic and a little seeded noise; each
    channel an octave apart, so a downmix is not just a copy."""
    t = np.arange(round(seconds * sampling_rate)) / sampling_rate
    noise = np.random.default_rng(seed).normal(0.0, 0.01, size=(t.size, channels))
    columns = [
        0.3 * np.sin(2 * np.pi * freq * (c + 1) * t) + 0.1 * np.sin(2 * np.pi * 3 * freq * t)
        for c in range(channels)
    ]
    return (np.stack(columns, axis=1) + noise).astype(np.float32)


def write_audio(
    path: str | os.PathLike,
    seconds: float = 1.5,
    sampling_rate: int = 16000,
    *,
    channels: int = 1,
    freq: float = 440.0,
    seed: int = 0,
) -> Path:
    """Write a tone as .wav .flac .ogg .mp3 (libsndfile) or .m4a .opus .webm (PyAV)."""
    path = Path(path)
    samples = tone(seconds, sampling_rate, channels=channels, freq=freq, seed=seed)
    suffix = path.suffix.lower()
    if suffix in _SOUNDFILE_FORMATS:
        sf.write(path, samples, sampling_rate, format=_SOUNDFILE_FORMATS[suffix])
        return path
    fmt, codec = _suffix_format(path, _AV_AUDIO_FORMATS)
    with av.open(str(path), "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=sampling_rate)
        stream.layout = "mono" if channels == 1 else "stereo"
        _encode_audio(container, stream, samples, sampling_rate)
    return path


def write_video(
    path: str | os.PathLike,
    seconds: float = 2.0,
    fps: float = 4.0,
    width: int = 64,
    height: int = 48,
    *,
    with_audio: bool = False,
    audio_sampling_rate: int = 16000,
    seed: int = 0,
) -> Path:
    """Write an .mp4 (H.264 when PyAV has libx264, else MPEG-4 Part 2) with a moving square, and
    an AAC tone track when `with_audio`."""
    path = Path(path)
    if width % 2 or height % 2:
        raise ValueError(f"width and height must be even for yuv420p, got {width}x{height}")
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    rate = fractions.Fraction(fps).limit_denominator(1001)
    with av.open(str(path), "w", format="mp4") as container:
        # Every stream must exist before the first packet is muxed (that writes the header).
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        audio = container.add_stream("aac", rate=audio_sampling_rate) if with_audio else None
        if audio is not None:
            audio.layout = "mono"
        for i in range(round(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(image_array(width, height, seed=seed, frame=i))
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
        if audio is not None:
            samples = tone(seconds, audio_sampling_rate, seed=seed)
            _encode_audio(container, audio, samples, audio_sampling_rate)
    return path


def write_video_without_frame_rate(
    path: str | os.PathLike,
    num_frames: int = 12,
    width: int = 64,
    height: int = 48,
    *,
    seed: int = 0,
) -> Path:
    """Write a WebM (VP8) whose stream has no usable frame-rate metadata, like a browser's
    MediaRecorder output: no codec frame rate, 1 ms timestamps, irregular gaps between frames.

    Read back, `average_rate` is None and `guessed_rate` / `base_rate` fall back to the Matroska
    tick rate, 1000 fps, which no real camera produced.
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    tick = fractions.Fraction(1, 1000)
    with av.open(str(path), "w", format="webm") as container:
        stream = container.add_stream("libvpx")
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = stream.codec_context.time_base = tick
        stream.codec_context.framerate = fractions.Fraction(0, 1)  # "unknown", as browsers write
        pts = 0
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(image_array(width, height, seed=seed, frame=i))
            frame.pts, frame.time_base = pts, tick
            container.mux(stream.encode(frame))
            pts += int(rng.integers(30, 300))  # variable frame durations, in ms
        container.mux(stream.encode())
    return path


def write_video_without_video_stream(path: str | os.PathLike, seconds: float = 1.0) -> Path:
    """Write an audio-only .mp4 (AAC), a container a video decoder must refuse clearly."""
    path = Path(path)
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        stream.layout = "mono"
        _encode_audio(container, stream, tone(seconds, 16000), 16000)
    return path


def _encode_audio(
    container: av.container.OutputContainer,
    stream: av.audio.stream.AudioStream,
    samples: np.ndarray,
    sampling_rate: int,
) -> None:
    """Encode `(num_samples, channels)` float32 through `stream`, in 1024-sample frames."""
    layout = "mono" if samples.shape[1] == 1 else "stereo"
    planar = np.ascontiguousarray(samples.T)
    for start in range(0, planar.shape[1], 1024):
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(planar[:, start : start + 1024]), format="fltp", layout=layout
        )
        frame.sample_rate, frame.pts = sampling_rate, start
        container.mux(stream.encode(frame))
    container.mux(stream.encode())


def _suffix_format(path: Path, formats: dict[str, Any]) -> Any:
    try:
        return formats[path.suffix.lower()]
    except KeyError:
        raise ValueError(f"{path}: unsupported suffix; use one of {sorted(formats)}") from None
