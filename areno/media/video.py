"""Video decoding with PyAV: pick frames by a target fps, decode only up to the last one needed."""

from __future__ import annotations

import logging
import math

import av
import numpy as np

from areno.media.decode import (
    DEFAULT_MAX_AUDIO_SECONDS,
    DEFAULT_MAX_VIDEO_FRAME_PIXELS,
    MAX_PLAUSIBLE_FPS,
    decode_av_audio,
    decode_error,
    found_names,
    hash_bytes,
    library_errors,
    open_container,
    too_large,
)
from areno.media.errors import MissingFrameRateError
from areno.media.types import DecodedAudio, DecodedVideo

logger = logging.getLogger(__name__)

_REMUX_HINT = (
    "remux it with a constant frame rate, e.g. `ffmpeg -i in.webm -c copy -r 30 out.mp4`, or "
    "re-encode it (`ffmpeg -i in.webm -r 30 out.mp4`)"
)


def decode_video(
    data: bytes,
    source: str,
    *,
    fps: float = 2.0,
    max_frames: int = 32,
    with_audio: bool = False,
    audio_sampling_rate: int = 16000,
    max_frame_pixels: int = DEFAULT_MAX_VIDEO_FRAME_PIXELS,
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
    content_hash: str | None = None,
) -> DecodedVideo:
    """Decode the frames sampled at `fps` (at most `max_frames`) of the first video stream.

    Frames are RGB uint8 `(num_frames, H, W, 3)`. With `with_audio`, the audio track (if any) is
    decoded to mono float32 at `audio_sampling_rate` into `DecodedVideo.audio`.
    """
    if not fps > 0 or max_frames < 1:
        raise ValueError(f"fps must be > 0 and max_frames >= 1, got {fps} and {max_frames}")
    digest = content_hash or hash_bytes(data)
    found: dict[str, str] = {}
    with library_errors("a video", source, found):
        with open_container(data, "a video", source, found) as container:
            stream = _video_stream(container, source, found)
            stream_fps = _frame_rate(stream, source, found)
            total = stream.frames or _count_packets(container, stream)
        if total <= 0:
            raise decode_error(
                "a video", source, "the video stream has no frames", **found_names(found)
            )
        indices = sample_frame_indices(total, stream_fps, fps, max_frames)
        frames, indices, total = _decode_frames(data, source, indices, total, max_frame_pixels)
        audio = None
        if with_audio:
            audio = _decode_track_audio(
                data, source, audio_sampling_rate, max_audio_seconds, digest, found
            )
    return DecodedVideo(
        frames=frames,
        fps=stream_fps,
        frame_indices=indices,
        total_num_frames=total,
        duration_s=total / stream_fps,
        content_hash=digest,
        source=source,
        audio=audio,
    )


def sample_frame_indices(
    total_num_frames: int, stream_fps: float, target_fps: float, max_frames: int
) -> list[int]:
    """Indices of the frames to keep: every `stream_fps / target_fps`-th frame (never more
    often than the stream's own rate), then uniformly subsampled down to `max_frames`."""
    step = stream_fps / min(target_fps, stream_fps)
    num = max(1, math.floor((total_num_frames - 1) / step) + 1)
    # floor(x + 0.5) rather than round(): banker's rounding could map two picks to one frame.
    picks = [min(total_num_frames - 1, math.floor(k * step + 0.5)) for k in range(num)]
    if len(picks) > max_frames:
        positions = np.floor(np.linspace(0, len(picks) - 1, max_frames) + 0.5).astype(int)
        picks = [picks[p] for p in positions]
    return picks


def _video_stream(
    container: av.container.InputContainer, source: str, found: dict[str, str]
) -> av.video.stream.VideoStream:
    stream = next((s for s in container.streams if s.type == "video"), None)
    if stream is None:
        kinds = ", ".join(s.type for s in container.streams) or "none"
        raise decode_error(
            "a video",
            source,
            f"the file has no video stream (streams: {kinds})",
            **found_names(found),
        )
    found["codec"] = stream.codec_context.name
    return stream


def _frame_rate(stream: av.video.stream.VideoStream, source: str, found: dict[str, str]) -> float:
    """The stream's frame rate, from the first usable of average / guessed / base rate."""
    rates = (stream.average_rate, stream.guessed_rate, stream.base_rate)
    for rate in rates:
        if rate and 0 < float(rate) <= MAX_PLAUSIBLE_FPS:
            return float(rate)
    avg, guessed, base = (str(r) if r else "none" for r in rates)
    raise MissingFrameRateError(
        f"the video stream in {source} [container {found.get('container')}, codec "
        f"{found.get('codec')}] has no usable frame-rate metadata (average_rate={avg}, "
        f"guessed_rate={guessed}, base_rate={base}), so frame timestamps cannot be computed; "
        f"{_REMUX_HINT}"
    )


def _count_packets(
    container: av.container.InputContainer, stream: av.video.stream.VideoStream
) -> int:
    """Frames in a stream whose container does not say (Matroska, WebM): count its packets,
    which needs demuxing only, not decoding."""
    return sum(1 for packet in container.demux(stream) if packet.size)


def _decode_frames(
    data: bytes, source: str, indices: list[int], total: int, max_frame_pixels: int
) -> tuple[np.ndarray, list[int], int]:
    """Decode sequentially, keep `indices`, stop after the last one. Returns the frames, the
    indices actually found and the frame count (smaller when the stream ends early)."""
    wanted, last = set(indices), indices[-1]
    kept: list[np.ndarray] = []
    kept_indices: list[int] = []
    found: dict[str, str] = {}
    with open_container(data, "a video", source, found) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_frame_size(width, height, source, max_frame_pixels)
        num_decoded = 0
        for num_decoded, frame in enumerate(container.decode(stream), start=1):
            index = num_decoded - 1
            if index in wanted:
                _check_frame_size(frame.width, frame.height, source, max_frame_pixels)
                # Resolution can change mid-stream; scale to the first frame's so frames stack.
                size = {"width": width or frame.width, "height": height or frame.height}
                kept.append(frame.to_ndarray(format="rgb24", **size))
                kept_indices.append(index)
            if index >= last:
                break
        else:
            # The stream ended before the last wanted frame. FFmpeg decodes what a truncated
            # file holds, and edit lists can legitimately hide frames, so keep what we have.
            logger.warning(
                "%s: the container counts %d frames but only %d decoded", source, total, num_decoded
            )
            total = num_decoded
    if not kept:
        raise decode_error(
            "a video", source, "no video frame could be decoded", **found_names(found)
        )
    return np.stack(kept), kept_indices, total


def _check_frame_size(width: int, height: int, source: str, max_frame_pixels: int) -> None:
    if width * height > max_frame_pixels:
        raise too_large(
            source,
            f"the video frame size {width}x{height} in pixels",
            width * height,
            max_frame_pixels,
            "max_video_frame_pixels",
        )


def _decode_track_audio(
    data: bytes,
    source: str,
    sampling_rate: int,
    max_seconds: float,
    digest: str,
    found: dict[str, str],
) -> DecodedAudio | None:
    """The first audio track as mono float32, or None when the file has none (or it is empty)."""
    with open_container(data, "a video", source, found) as container:
        stream = next((s for s in container.streams if s.type == "audio"), None)
        if stream is None:
            return None
        found["codec"] = stream.codec_context.name
        waveform = decode_av_audio(container, stream, source, sampling_rate, max_seconds)
    if waveform.size == 0:
        return None
    return DecodedAudio(
        waveform=waveform, sampling_rate=sampling_rate, content_hash=digest, source=source
    )
