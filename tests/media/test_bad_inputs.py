"""Every kind of bad media input gets its own error class and a message the user can act on."""

from __future__ import annotations

import base64
import io
import os
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import av
import numpy as np
import pytest
import soundfile as sf

from areno.media import (
    InvalidMediaURLError,
    MediaAccessDeniedError,
    MediaDecodeError,
    MediaDecoder,
    MediaError,
    MediaFetchError,
    MediaNotFoundError,
    MediaPolicy,
    MediaRef,
    MediaTooLargeError,
    MissingFrameRateError,
    UnsupportedMediaTypeError,
    decode_audio,
    decode_image,
    decode_video,
)
from areno.media import samples as media_samples
from tests.media.conftest import png_header_only


@pytest.fixture(scope="module")
def ctx(tmp_path_factory, media_files, http_server) -> SimpleNamespace:
    """An allowed root full of bad files, a directory outside it, and the test server."""
    root = tmp_path_factory.mktemp("root")
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.png").write_bytes(media_files.png.read_bytes())
    (root / "escape.png").symlink_to(outside / "secret.png")
    (root / "a_directory.png").mkdir()
    png, jpg, mp4 = (f.read_bytes() for f in (media_files.png, media_files.jpg, media_files.mp4))
    bad_files = {
        "truncated.png": png[: len(png) // 2],
        "random.png": random.Random(0).randbytes(2000),
        "text.wav": b"RIFF? no, this is a text file pretending to be a WAV.\n" * 10,
        "text.mp4": b"just text\n" * 50,
        "zero.png": b"",
        "huge.png": png_header_only(100_000, 100_000),
        "big.png": png_header_only(9000, 9000),
        "truncated.jpg": jpg[: len(jpg) // 2],
        "truncated.mp4": mp4[: len(mp4) // 2],
        "empty.wav": _empty_wav(),
        "endless.flac": _flac_declaring(media_files.flac.read_bytes(), 2**36 - 1),
        "vector.eps": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n",
    }
    for name, data in bad_files.items():
        (root / name).write_bytes(data)
    for name in ("png", "wav", "m4a", "mp4", "webm_no_fps", "mp4_audio_only", "p_gif"):
        source = getattr(media_files, name)
        (root / source.name).write_bytes(source.read_bytes())
    policy = MediaPolicy(allowed_local_media_paths=(str(root),))
    return SimpleNamespace(
        root=root,
        outside=outside,
        hostname=socket.gethostname(),
        server=http_server,
        policy=policy,
        png_data_url="data:image/png;base64," + base64.b64encode(png).decode(),
    )


def _flac_declaring(flac: bytes, num_samples: int) -> bytes:
    """A real FLAC whose STREAMINFO claims `num_samples` (36-bit field at byte 21 onwards)."""
    data = bytearray(flac)
    data[21] = (data[21] & 0xF0) | (num_samples >> 32)
    data[22:26] = (num_samples & 0xFFFFFFFF).to_bytes(4, "big")
    return bytes(data)


def _empty_wav() -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, np.zeros((0, 1), np.float32), 16000, format="WAV")
    return buffer.getvalue()


def decode(ctx, modality: str, url: str, policy: MediaPolicy | None = None, **overrides):
    return MediaDecoder(policy or ctx.policy).decode(MediaRef(modality, url), **overrides)


def local(name: str, modality: str = "image", **overrides) -> Callable:
    return lambda c: decode(c, modality, f"{c.root}/{name}", **overrides)


def remote(url: str, **policy) -> Callable:
    return lambda c: decode(c, "image", url.format(server=c.server), MediaPolicy(**policy))


REMOTE_ON = {"allow_remote": True}
REMOTE_PRIVATE = {"allow_remote": True, "allow_private_network": True}


@dataclass(frozen=True)
class Bad:
    id: str
    run: Callable[[SimpleNamespace], object]
    error: type[MediaError]
    needles: tuple[str, ...]  # formatted with the ctx fields, then looked for in the message
    loopback_is_public: bool = False  # let the 127.0.0.1 test server stand in for a public host


CASES = [
    # --- local files ---
    Bad(
        "missing_file",
        local("missing.png"),
        MediaNotFoundError,
        ("{root}/missing.png", "{hostname}"),
    ),
    Bad(
        "directory",
        local("a_directory.png"),
        MediaNotFoundError,
        ("a_directory.png", "is a directory"),
    ),
    Bad(
        "outside_roots",
        lambda c: decode(c, "image", f"{c.outside}/secret.png"),
        MediaAccessDeniedError,
        ("{outside}/secret.png", "--allowed-local-media-path"),
    ),
    Bad(
        "dotdot_traversal",
        lambda c: decode(c, "image", f"{c.root}/../{c.outside.name}/secret.png"),
        MediaAccessDeniedError,
        ("outside the allowed roots", "{outside}/secret.png"),
    ),
    Bad(
        "symlink_escape",
        local("escape.png"),
        MediaAccessDeniedError,
        ("resolves to '{outside}/secret.png'", "--allowed-local-media-path"),
    ),
    Bad(
        "local_refused_on_public_server",
        lambda c: decode(c, "image", f"{c.root}/image.png", MediaPolicy.for_server("0.0.0.0")),
        MediaAccessDeniedError,
        ("local media files are disabled", "--allowed-local-media-path"),
    ),
    Bad(
        "nul_byte_in_path",
        lambda c: decode(c, "image", f"{c.root}/image.png\x00.txt"),
        InvalidMediaURLError,
        ("NUL byte",),
    ),
    Bad(
        "local_over_byte_cap",
        lambda c: decode(c, "image", f"{c.root}/image.png", MediaPolicy(("/",), max_bytes=64)),
        MediaTooLargeError,
        ("over the limit of 64 bytes",),
    ),
    # --- URLs ---
    Bad(
        "file_url_remote_host",
        lambda c: decode(c, "image", "file://fileserver/etc/passwd"),
        UnsupportedMediaTypeError,
        ("'fileserver'", "file:///abs/path"),
    ),
    Bad(
        "file_url_relative",
        lambda c: decode(c, "image", "file:image.png"),
        InvalidMediaURLError,
        ("absolute path",),
    ),
    Bad(
        "ftp_scheme",
        lambda c: decode(c, "image", "ftp://example.com/a.png"),
        UnsupportedMediaTypeError,
        ("'ftp'",),
    ),
    Bad(
        "gopher_scheme",
        lambda c: decode(c, "image", "gopher://example.com/a.png"),
        UnsupportedMediaTypeError,
        ("'gopher'",),
    ),
    Bad("empty_url", lambda c: decode(c, "image", ""), InvalidMediaURLError, ("empty",)),
    Bad(
        "unknown_modality",
        lambda c: decode(c, "text", f"{c.root}/image.png"),
        UnsupportedMediaTypeError,
        ("'text'",),
    ),
    # --- data: URLs ---
    Bad(
        "bad_base64",
        lambda c: decode(c, "image", "data:image/png;base64,iVBORw0K@@@"),
        InvalidMediaURLError,
        ("invalid base64", "image/png"),
    ),
    Bad(
        "data_url_without_mime",
        lambda c: decode(c, "image", "data:;base64,iVBORw0KGgo="),
        UnsupportedMediaTypeError,
        ("no MIME type", "data:image/png;base64"),
    ),
    Bad(
        "data_url_without_comma",
        lambda c: decode(c, "image", "data:image/png;base64"),
        InvalidMediaURLError,
        ("no ','",),
    ),
    Bad(
        "image_data_url_as_audio",
        lambda c: decode(c, "audio", c.png_data_url),
        UnsupportedMediaTypeError,
        ("'image/png'", "given as audio", "audio/*"),
    ),
    Bad(
        "data_url_over_cap",
        lambda c: decode(c, "image", c.png_data_url, MediaPolicy(max_bytes=100)),
        MediaTooLargeError,
        ("over the limit of 100 bytes", "data URL (image/png"),
    ),
    # --- remote ---
    Bad(
        "remote_disabled",
        remote("{server}/file/image.png"),
        MediaAccessDeniedError,
        ("--allow-remote-media",),
    ),
    Bad(
        "remote_loopback",
        remote("{server}/file/image.png", **REMOTE_ON),
        MediaAccessDeniedError,
        ("127.0.0.1", "--allow-private-media-urls"),
    ),
    Bad(
        "remote_metadata_service",
        remote("http://169.254.169.254/latest/meta-data", **REMOTE_ON),
        MediaAccessDeniedError,
        ("169.254.169.254", "--allow-private-media-urls"),
    ),
    Bad(
        "remote_private_10",
        remote("http://10.0.0.1/a.png", **REMOTE_ON),
        MediaAccessDeniedError,
        ("10.0.0.1",),
    ),
    Bad(
        "remote_ipv6_loopback",
        remote("http://[::1]:8080/a.png", **REMOTE_ON),
        MediaAccessDeniedError,
        ("::1", "--allow-private-media-urls"),
    ),
    Bad(
        "remote_ipv4_mapped_ipv6",
        remote("http://[::ffff:127.0.0.1]/a.png", **REMOTE_ON),
        MediaAccessDeniedError,
        ("::ffff:127.0.0.1",),
    ),
    Bad(
        "remote_redirect_to_private_address",
        remote("{server}/to?url=http://10.0.0.1/internal.png", **REMOTE_ON),
        MediaAccessDeniedError,
        ("10.0.0.1", "--allow-private-media-urls"),
        loopback_is_public=True,
    ),
    Bad(
        "remote_http_404",
        remote("{server}/status/404", **REMOTE_PRIVATE),
        MediaFetchError,
        ("HTTP 404",),
    ),
    Bad(
        "remote_too_many_redirects",
        remote("{server}/redirect/5", **REMOTE_PRIVATE),
        MediaFetchError,
        ("max_redirects=3",),
    ),
    Bad(
        "remote_redirect_to_file",
        remote("{server}/to?url=file:///etc/passwd", **REMOTE_PRIVATE),
        MediaAccessDeniedError,
        ("file:///etc/passwd", "only redirects to http(s)"),
    ),
    Bad(
        "remote_over_byte_cap",
        remote("{server}/nolength/big.bin", max_bytes=1000, **REMOTE_PRIVATE),
        MediaTooLargeError,
        ("1000 bytes",),
    ),
    # --- images ---
    Bad(
        "truncated_png", local("truncated.png"), MediaDecodeError, ("PNG", "truncated", "re-encode")
    ),
    Bad(
        "random_bytes_png",
        local("random.png"),
        MediaDecodeError,
        ("random.png", "not a recognised image format"),
    ),
    Bad(
        "eps_not_an_accepted_format",
        local("vector.eps"),
        MediaDecodeError,
        ("vector.eps", "supported: PNG, JPEG"),
    ),
    Bad("zero_byte_file", local("zero.png"), MediaDecodeError, ("zero.png", "empty (0 bytes)")),
    Bad("truncated_jpeg", local("truncated.jpg"), MediaDecodeError, ("JPEG", "truncated")),
    Bad(
        "huge_declared_png",
        local("huge.png"),
        MediaTooLargeError,
        ("10000000000 pixels", "67108864"),
    ),
    Bad(
        "declared_png_over_default_cap",
        local("big.png"),
        MediaTooLargeError,
        ("9000x9000", "81000000", "67108864", "max_image_pixels"),
    ),
    Bad(
        "pixels_over_configured_cap",
        local("image.png", max_image_pixels=1000),
        MediaTooLargeError,
        ("64x48", "3072", "1000", "max_image_pixels"),
    ),
    Bad("wav_given_as_image", local("tone.wav"), MediaDecodeError, ("not a recognised image",)),
    # --- audio ---
    Bad(
        "text_named_wav",
        local("text.wav", "audio"),
        MediaDecodeError,
        ("text.wav", "FFmpeg cannot open it"),
    ),
    Bad(
        "zero_length_audio",
        local("empty.wav", "audio"),
        MediaDecodeError,
        ("contains no samples", "WAV"),
    ),
    Bad("zero_byte_audio", local("zero.png", "audio"), MediaDecodeError, ("empty (0 bytes)",)),
    Bad(
        "audio_over_duration_cap",
        local("tone.wav", "audio", max_audio_seconds=1.0),
        MediaTooLargeError,
        ("is 1.50, over the limit of 1", "max_audio_seconds", "tone.wav"),
    ),
    Bad(
        "flac_declaring_50_days",  # refused from the header, before anything is allocated
        local("endless.flac", "audio"),
        MediaTooLargeError,
        ("4294967.30", "over the limit of 1200", "max_audio_seconds"),
    ),
    Bad(
        "m4a_over_duration_cap",
        local("tone.m4a", "audio", max_audio_seconds=0.5),
        MediaTooLargeError,
        ("over the limit of 0.50", "max_audio_seconds"),
    ),
    Bad(
        "gif_given_as_audio",
        local("palette.gif", "audio"),
        MediaDecodeError,
        ("has no audio stream", "gif"),
    ),
    # --- video ---
    Bad(
        "mp4_without_video_stream",
        local("audio_only.mp4", "video"),
        MediaDecodeError,
        ("has no video stream", "streams: audio", "mov,mp4"),
    ),
    Bad(
        "video_without_frame_rate",
        local("nofps.webm", "video"),
        MissingFrameRateError,
        (
            "no usable frame-rate metadata",
            "remux",
            "ffmpeg -i in.webm -c copy -r 30 out.mp4",
            "matroska,webm",
            "vp8",
        ),
    ),
    Bad(
        "truncated_mp4",
        local("truncated.mp4", "video"),
        MediaDecodeError,
        ("truncated.mp4", "corrupt, truncated"),
    ),
    Bad("text_named_mp4", local("text.mp4", "video"), MediaDecodeError, ("FFmpeg cannot open it",)),
    Bad(
        "wav_given_as_video",
        local("tone.wav", "video"),
        MediaDecodeError,
        ("has no video stream", "container wav"),
    ),
    Bad(
        "video_frame_over_pixel_cap",
        local("clip.mp4", "video", max_video_frame_pixels=100),
        MediaTooLargeError,
        ("64x48", "max_video_frame_pixels"),
    ),
]


def test_enough_distinct_cases():
    assert len({case.id for case in CASES}) == len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input(ctx, case: Bad, request):
    if case.loopback_is_public:
        request.getfixturevalue("loopback_is_public")
    with pytest.raises(MediaError) as info:
        case.run(ctx)
    assert type(info.value) is case.error, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for needle in case.needles:
        assert needle.format(**vars(ctx)) in message, message
    assert info.value.status_code in (400, 403, 413, 415)
    assert info.value.to_dict()["code"] == case.error.code


def test_error_codes_are_distinct():
    classes = {case.error for case in CASES}
    assert len({cls.code for cls in classes}) == len(classes)


# --- no library exception escapes on damaged bytes --------------------------------------------


def _mutations(data: bytes, seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 16)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        cut = rng.choice([len(buf), rng.randrange(1, len(buf))])
        out.append(bytes(buf[:cut]))
    return out


@pytest.mark.parametrize(
    ("name", "decode_fn"),
    [
        ("png", lambda d: decode_image(d, "x")),
        ("jpg", lambda d: decode_image(d, "x")),
        ("p_gif", lambda d: decode_image(d, "x")),
        ("wav", lambda d: decode_audio(d, "x", sampling_rate=16000)),
        ("flac", lambda d: decode_audio(d, "x", sampling_rate=16000)),
        ("mp3_stereo_44k", lambda d: decode_audio(d, "x", sampling_rate=16000)),
        ("m4a", lambda d: decode_audio(d, "x", sampling_rate=16000)),
        ("mp4", lambda d: decode_video(d, "x")),
        ("webm_no_fps", lambda d: decode_video(d, "x")),
    ],
)
def test_damaged_bytes_raise_only_media_errors(media_files, name, decode_fn):
    data = getattr(media_files, name).read_bytes()
    for seed, damaged in enumerate(_mutations(data, seed=len(name), count=25)):
        try:
            decode_fn(damaged)
        except MediaError:
            pass
        except Exception as exc:  # noqa: BLE001 - the point: nothing else may escape
            pytest.fail(f"{name} mutation {seed}: {type(exc).__name__}: {exc}")


def test_playlist_cannot_make_ffmpeg_read_other_files(media_files, monkeypatch):
    # An ffconcat playlist names a file relative to the cwd; plain FFmpeg would open and decode
    # it, bypassing MediaPolicy. The decoder must refuse to open anything nested.
    monkeypatch.chdir(media_files.dir)
    playlist = f"ffconcat version 1.0\nfile {media_files.mp4.name}\n".encode()
    with av.open(io.BytesIO(playlist)) as container:  # the threat is real...
        assert sum(1 for _ in container.decode(video=0)) == 8
    with pytest.raises(MediaDecodeError, match="FFmpeg cannot open it"):  # ...and blocked
        decode_video(playlist, "playlist")
    hls = f"#EXTM3U\n#EXTINF:2,\n{media_files.mp4.name}\n#EXT-X-ENDLIST\n".encode()
    with pytest.raises(MediaDecodeError):
        decode_video(hls, "playlist.m3u8")


def test_sample_writers_reject_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match="unsupported suffix"):
        media_samples.write_image(tmp_path / "x.tiff")
    assert not os.path.exists(tmp_path / "x.tiff")
