"""Hand-made hostile media for tests/serve/live/test_hostile_inputs.py: bombs, lying headers,
broken containers. Each builder returns bytes; `write_hostile_files` lays them out in a media
root."""

from __future__ import annotations

import io
import os
import struct
import zlib
from pathlib import Path

from areno.media import samples
from tests.media.conftest import png_header_only

# What the files outside the allowed root hold; no response or log line may ever contain it.
SECRET = b"ARENO-OUTSIDE-ROOT-SECRET-7f3a9c"


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def compressible_giant_png(width: int, height: int) -> bytes:
    """A real, complete grayscale PNG of zeros: tens of KB on the wire, width*height in memory."""
    compressor, row, parts = zlib.compressobj(9), b"\0" * (width + 1), []
    parts.extend(compressor.compress(row) for _ in range(height))
    parts.append(compressor.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", b"".join(parts))
        + _png_chunk(b"IEND", b"")
    )


def png_with_chunk_bomb(png: bytes, kind: bytes) -> bytes:
    """`png` with a zTXt / iCCP chunk that inflates to 8 MB (Pillow stops at 1 MB), after IHDR."""
    keyword = b"k\0\0" if kind == b"zTXt" else b"profile\0\0"
    bomb = _png_chunk(kind, keyword + zlib.compress(b"A" * 8_000_000, 9))
    return png[:33] + bomb + png[33:]


def with_jpeg_size(jpeg: bytes, width: int, height: int) -> bytes:
    """`jpeg` whose SOF0 frame header declares `width`x`height`."""
    at = jpeg.index(b"\xff\xc0")
    return jpeg[: at + 5] + struct.pack(">HH", height, width) + jpeg[at + 9 :]


def with_gif_screen(gif: bytes, width: int, height: int) -> bytes:
    """`gif` whose logical screen descriptor declares `width`x`height`."""
    return gif[:6] + struct.pack("<HH", width, height) + gif[10:]


def with_bmp_size(bmp: bytes, width: int, height: int) -> bytes:
    return bmp[:18] + struct.pack("<ii", width, height) + bmp[26:]


def pcm_wav(rate: int, num_frames: int) -> bytes:
    """A 16-bit mono PCM WAV with any declared sample rate (soundfile refuses to write odd ones)."""
    data = b"\0\0" * num_frames
    fmt = struct.pack("<HHIIHH", 1, 1, rate, (rate * 2) & 0xFFFFFFFF, 2, 16)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data))
    return b"RIFF" + struct.pack("<I", 4 + len(chunks) + len(data)) + b"WAVE" + chunks + data


def flac_declaring(flac: bytes, num_samples: int) -> bytes:
    """A real FLAC whose STREAMINFO claims `num_samples` (36-bit field at byte 21 onwards)."""
    data = bytearray(flac)
    data[21] = (data[21] & 0xF0) | (num_samples >> 32)
    data[22:26] = (num_samples & 0xFFFFFFFF).to_bytes(4, "big")
    return bytes(data)


def mjpeg_mkv(width: int, height: int, num_frames: int = 1) -> bytes:
    """A Matroska video of flat MJPEG frames (small on the wire whatever the size)."""
    import av
    import numpy as np

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska") as container:
        stream = container.add_stream("mjpeg", rate=4)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuvj420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24")
        for _ in range(num_frames):
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


def with_frame_sizes(video: bytes, width: int, height: int) -> bytes:
    """`video` (MJPEG) whose every frame's SOF0 header declares `width`x`height`, while the
    container still declares the original size."""
    out, at = bytearray(video), video.find(b"\xff\xc0")
    while at != -1:
        out[at + 5 : at + 9] = struct.pack(">HH", height, width)
        at = video.find(b"\xff\xc0", at + 1)
    return bytes(out)


def mp4_without_moov_data(mp4: bytes) -> bytes:
    """The MP4's ftyp box alone: a container that announces itself and holds no stream."""
    at = mp4.index(b"ftyp") - 4
    return mp4[at : at + struct.unpack(">I", mp4[at : at + 4])[0]]


def with_zeroed_box(mp4: bytes, kind: bytes) -> bytes:
    """`mp4` with the body of its first `kind` box overwritten by zeros (a broken stream table)."""
    at = mp4.index(kind) - 4
    size = struct.unpack(">I", mp4[at : at + 4])[0]
    return mp4[: at + 8] + b"\0" * (size - 8) + mp4[at + size :]


def write_hostile_files(root: Path, outside: Path) -> dict[str, Path]:
    """The allowed media root (good files, bad files, escapes) and a directory outside it."""
    good = {
        "image.png": samples.write_image(root / "image.png", 32, 24),
        "image.jpg": samples.write_image(root / "image.jpg", 32, 24),
        "palette.gif": samples.write_image(root / "palette.gif", 32, 24, mode="P"),
        "image.bmp": samples.write_image(root / "image.bmp", 32, 24),
        "tone.wav": samples.write_audio(root / "tone.wav", 1.0),
        "tone.flac": samples.write_audio(root / "tone.flac", 1.0),
        "clip.mp4": samples.write_video(root / "clip.mp4", seconds=1.0, fps=4.0),
        "nofps.webm": samples.write_video_without_frame_rate(root / "nofps.webm"),
        "audio_only.mp4": samples.write_video_without_video_stream(root / "audio_only.mp4"),
    }
    read = {name: path.read_bytes() for name, path in good.items()}
    png, mp4 = read["image.png"], read["clip.mp4"]
    bad = {
        "header_bomb.png": png_header_only(100_000, 100_000),
        "giant_zeros.png": compressible_giant_png(9000, 9000),
        "ztxt_bomb.png": png_with_chunk_bomb(png, b"zTXt"),
        "iccp_bomb.png": png_with_chunk_bomb(png, b"iCCP"),
        "huge.jpg": with_jpeg_size(read["image.jpg"], 65_500, 65_500),
        "huge_screen.gif": with_gif_screen(read["palette.gif"], 65_535, 65_535),
        "huge.bmp": with_bmp_size(read["image.bmp"], 60_000, 60_000),
        "svg.png": b'<svg xmlns="http://www.w3.org/2000/svg" width="99999" height="99999"/>',
        "eps.png": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n",
        "truncated.png": png[: len(png) // 2],
        "rate1_2000s.wav": pcm_wav(1, 2000),
        "rate0.wav": pcm_wav(0, 2000),
        "rate_max.wav": pcm_wav(0xFFFFFFFF, 2000),
        "rate_2ghz.wav": pcm_wav(2_000_000_000, 2000),
        "50_days.flac": flac_declaring(read["tone.flac"], 2**36 - 1),
        "text.wav": b"RIFF? no, this is a text file pretending to be a WAV.\n" * 10,
        "empty.wav": pcm_wav(16000, 0),
        "ftyp_only.mp4": mp4_without_moov_data(mp4),
        "truncated.mp4": mp4[: len(mp4) // 2],
        "zeroed_stsd.mp4": with_zeroed_box(mp4, b"stsd"),
        "zeroed_stco.mp4": with_zeroed_box(mp4, b"stco"),
        "frames_over_cap.mkv": mjpeg_mkv(4200, 4200),
        "frames_lying.mkv": with_frame_sizes(mjpeg_mkv(32, 32, num_frames=4), 16_000, 16_000),
        "playlist.mp4": f"ffconcat version 1.0\nfile {outside / 'secret.mp4'}\n".encode(),
        "hls.mp4": f"#EXTM3U\n#EXTINF:1,\nfile://{outside / 'secret.mp4'}\n#EXT-X-ENDLIST\n".encode(),
        "secret_as_text.png": SECRET * 4,
    }
    files = dict(good)
    for name, data in bad.items():
        (root / name).write_bytes(data)
        files[name] = root / name
    (outside / "secret.png").write_bytes(SECRET + png)
    (outside / "secret.mp4").write_bytes(mp4)
    (root / "escape.png").symlink_to(outside / "secret.png")
    (root / "dev_zero.png").symlink_to("/dev/zero")
    (root / "a_directory.png").mkdir()
    os.mkfifo(root / "fifo.png")
    with open(root / "sparse_300mb.png", "wb") as f:  # no disk used: only its size is read
        f.truncate(300 * 1024 * 1024)
    return files


def png_with_text(marker: str) -> bytes:
    """A valid PNG carrying `marker` in a tEXt chunk (to look for its bytes in logs)."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", marker)
    buffer = io.BytesIO()
    Image.fromarray(samples.image_array(32, 24, seed=5)).save(buffer, "PNG", pnginfo=info)
    return buffer.getvalue()
