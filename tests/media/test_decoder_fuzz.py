"""Fuzzed media bytes either decode or raise a MediaError: never another exception, never a hang.

Valid PNG / JPEG / GIF / WAV / FLAC / MP4 files (written with Pillow, soundfile and PyAV) are
damaged by hypothesis (bytes flipped, overwritten, inserted, deleted or repeated, the file cut
short), mostly in the first few hundred bytes where the headers that size every allocation live,
and decoded through the same `MediaDecoder` path the server takes (a data URL, the default
limits). A decode that runs past `HANG_S` dumps every thread's stack and ends the run.
"""

from __future__ import annotations

import base64
import faulthandler
import functools
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areno.media import (
    DecodedAudio,
    DecodedImage,
    DecodedVideo,
    MediaDecoder,
    MediaError,
    MediaPolicy,
    MediaRef,
    samples,
)

HANG_S = 30.0
FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
HEADER_BYTES = 512  # most damage lands here: headers declare sizes, rates and counts

# name -> (writer, modality, decoded type, MIME type of its data URL)
SOURCES = {
    "png": (lambda d: samples.write_image(d / "a.png", 32, 24), "image", DecodedImage, "image/png"),
    "jpg": (
        lambda d: samples.write_image(d / "a.jpg", 32, 24),
        "image",
        DecodedImage,
        "image/jpeg",
    ),
    "gif": (
        lambda d: samples.write_image(d / "a.gif", 32, 24, mode="P"),
        "image",
        DecodedImage,
        "image/gif",
    ),
    "wav": (lambda d: samples.write_audio(d / "a.wav", 0.5), "audio", DecodedAudio, "audio/wav"),
    "flac": (lambda d: samples.write_audio(d / "a.flac", 0.5), "audio", DecodedAudio, "audio/flac"),
    "mp4": (
        lambda d: samples.write_video(d / "a.mp4", seconds=1.0, fps=4.0, with_audio=True),
        "video",
        DecodedVideo,
        "video/mp4",
    ),
}


@functools.cache
def original(name: str) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        return SOURCES[name][0](Path(d)).read_bytes()


@functools.cache
def decoder() -> MediaDecoder:
    """No cache: every example decodes. Video with its audio track, as Gemma 4 asks."""
    from areno.media import DecodeOptions

    options = DecodeOptions(video_with_audio=True, max_video_frames=4)
    return MediaDecoder(MediaPolicy(), options, max_cache_entries=0)


@st.composite
def damaged(draw, data: bytes) -> bytes:
    """`data` after 1-8 random edits."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 8))):
        if not buf:
            break
        limit = min(len(buf), HEADER_BYTES) if draw(st.integers(0, 3)) else len(buf)
        at = draw(st.integers(0, limit - 1))
        edit = draw(st.sampled_from(["flip", "set", "insert", "delete", "repeat", "cut"]))
        if edit == "flip":
            buf[at] ^= 1 << draw(st.integers(0, 7))
        elif edit == "set":  # 0x00 / 0xff / 0x7f are the values that turn sizes absurd
            buf[at] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80]) | st.integers(0, 255))
        elif edit == "insert":
            buf[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif edit == "delete":
            del buf[at : at + draw(st.integers(1, 16))]
        elif edit == "repeat":
            buf[at:at] = buf[at : at + draw(st.integers(1, 64))] * draw(st.integers(1, 4))
        else:
            del buf[at + 1 :]
    return bytes(buf)


def decode_or_media_error(name: str, data: bytes) -> object | None:
    """The decoded item, or None when decoding raised a MediaError (a 4xx)."""
    _, modality, decoded_type, mime = SOURCES[name]
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        decoded = decoder().decode(MediaRef(modality, url))
    except MediaError as exc:
        assert 400 <= exc.status_code < 500 and str(exc)
        return None
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert isinstance(decoded, decoded_type)
    return decoded


@pytest.mark.parametrize("name", list(SOURCES))
def test_damaged_media_decodes_or_raises_a_media_error(name):
    assert decode_or_media_error(name, original(name)) is not None  # undamaged, it decodes

    @FUZZ
    @given(damaged(original(name)))
    def check(data: bytes) -> None:
        decode_or_media_error(name, data)

    check()
