"""Reading a clip's time range: frames as PNG files, the audio track as a WAV file.

The tools run where the rollout worker runs, so the clip path is worker-local (as the decoder
reads it); a data URL is written to a cache file first. Outputs go to a cache directory keyed by
the clip's URL and the range, so the episodes of a group share them.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import soundfile as sf


def cache_root() -> Path:
    root = os.environ.get("ARENO_CACHE_DIR") or Path(tempfile.gettempdir())
    path = Path(root) / "ave-tools"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _key(url: str) -> str:
    return hashlib.sha1(url.encode()).hexdigest()[:16]


def local_path(url: str) -> Path:
    """The clip as a local file: a path as is (file:// stripped), a data URL written once."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        path = cache_root() / f"{_key(url)}.mp4"
        if not path.exists():
            data = base64.b64decode(payload) if ";base64" in header else payload.encode()
            _atomic_write(path, lambda tmp: tmp.write_bytes(data))
        return path
    return Path(url.removeprefix("file://"))


@dataclass(frozen=True)
class ClipInfo:
    path: Path
    duration_s: float
    has_audio: bool


def probe(url: str) -> ClipInfo:
    path = local_path(url)
    with av.open(str(path)) as container:
        duration = (container.duration or 0) / av.time_base
        has_audio = bool(container.streams.audio)
    return ClipInfo(path, duration, has_audio)


def frames_in(
    info: ClipInfo, start_s: float, end_s: float, max_frames: int
) -> list[tuple[float, Path]]:
    """Up to `max_frames` frames with start_s <= t < end_s, evenly spread: (time, PNG path)."""
    out_dir = cache_root() / _key(str(info.path))
    out_dir.mkdir(exist_ok=True)
    with av.open(str(info.path)) as container:
        decoded = [
            (float(frame.time), frame)
            for frame in container.decode(video=0)
            if start_s <= float(frame.time) < end_s
        ]
    if len(decoded) > max_frames:
        picks = np.linspace(0, len(decoded) - 1, max_frames).round().astype(int)
        decoded = [decoded[i] for i in picks]
    result = []
    for t, frame in decoded:
        path = out_dir / f"frame-{round(t * 1000):07d}ms.png"
        if not path.exists():
            image = frame.to_image()
            _atomic_write(path, lambda tmp, image=image: image.save(tmp, format="PNG"))
        result.append((t, path))
    return result


def audio_range(info: ClipInfo, start_s: float, end_s: float) -> tuple[Path, float]:
    """The audio of [start_s, end_s) as a mono WAV: (path, its duration in seconds)."""
    with av.open(str(info.path)) as container:
        stream = container.streams.audio[0]
        rate = stream.rate
        chunks = [frame.to_ndarray().mean(axis=0) for frame in container.decode(audio=0)]
    samples = np.concatenate(chunks).astype(np.float32)
    a, b = round(start_s * rate), min(round(end_s * rate), samples.size)
    piece = samples[a:b]
    path = (
        cache_root()
        / _key(str(info.path))
        / f"audio-{round(start_s * 1000)}-{round(end_s * 1000)}ms.wav"
    )
    path.parent.mkdir(exist_ok=True)
    if not path.exists():
        _atomic_write(path, lambda tmp: sf.write(tmp, piece, rate, format="WAV"))
    return path, piece.size / rate


def _atomic_write(path: Path, write) -> None:
    # Episodes of a group run concurrently: never let one read another's half-written file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(write)}.tmp")
    write(tmp)
    tmp.replace(path)
