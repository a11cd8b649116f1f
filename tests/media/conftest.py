"""Fixtures for the media tests: real sample files and a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import http.server
import ipaddress
import struct
import threading
import time
import zlib
from types import SimpleNamespace

import pytest

from areno.media import remote, samples


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares `width`x`height` but holds no pixel data (a decompression bomb
    stand-in: the header alone must be enough to refuse it)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


@pytest.fixture(scope="session")
def media_files(tmp_path_factory) -> SimpleNamespace:
    """One copy of every sample file, written once per session (the files are read-only)."""
    d = tmp_path_factory.mktemp("media")
    return SimpleNamespace(
        dir=d,
        png=samples.write_image(d / "image.png", 64, 48, seed=1),
        jpg=samples.write_image(d / "image.jpg", 64, 48, seed=2),
        jpg_rotated=samples.write_image(d / "rotated.jpg", 64, 48, orientation=6),
        rgba_png=samples.write_image(d / "rgba.png", mode="RGBA"),
        p_gif=samples.write_image(d / "palette.gif", mode="P"),
        l_png=samples.write_image(d / "grey.png", mode="L"),
        webp=samples.write_image(d / "image.webp"),
        wav=samples.write_audio(d / "tone.wav", 1.5, 16000),
        flac=samples.write_audio(d / "tone.flac", 1.5, 16000),
        ogg=samples.write_audio(d / "tone.ogg", 1.5, 16000),
        mp3_stereo_44k=samples.write_audio(d / "stereo.mp3", 2.0, 44100, channels=2),
        wav_stereo_44k=samples.write_audio(d / "stereo.wav", 2.0, 44100, channels=2),
        m4a=samples.write_audio(d / "tone.m4a", 1.5, 16000),
        mp4=samples.write_video(d / "clip.mp4", seconds=2.0, fps=4.0),
        mp4_with_audio=samples.write_video(d / "av.mp4", seconds=2.0, fps=4.0, with_audio=True),
        webm_no_fps=samples.write_video_without_frame_rate(d / "nofps.webm"),
        mp4_audio_only=samples.write_video_without_video_stream(d / "audio_only.mp4"),
    )


class _Handler(http.server.BaseHTTPRequestHandler):
    """Routes: /file/<name>, /nolength/<name>, /redirect/<n>, /to?url=..., /slow, /drip,
    /status/<code>. Bodies come from the server's `files` dict."""

    protocol_version = "HTTP/1.0"  # close-delimited bodies, so /nolength can omit the length

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        parts = self.path.split("?", 1)
        route, _, arg = parts[0].lstrip("/").partition("/")
        query = parts[1] if len(parts) > 1 else ""
        files = self.server.files
        if route == "file" and arg in files:
            self._send(200, files[arg], length=True)
        elif route == "nolength" and arg in files:
            self._send(200, files[arg], length=False)
        elif route == "redirect":
            hops = int(arg)
            self._redirect(f"/redirect/{hops - 1}" if hops > 1 else "/file/image.png")
        elif route == "to":
            self._redirect(query.removeprefix("url="))
        elif route == "slow":
            time.sleep(1.0)
            self._send(200, b"late", length=True)
        elif route == "drip":
            self.send_response(200)
            self.end_headers()
            for _ in range(20):
                self.wfile.write(b"x" * 10)
                self.wfile.flush()
                time.sleep(0.05)
        elif route == "status":
            self._send(int(arg), b"nope", length=True)
        else:
            self._send(404, b"not found", length=True)

    def _send(self, status: int, body: bytes, *, length: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        # The client may give up early (byte cap, timeout): that is the point of those tests.
        with contextlib.suppress(OSError):
            self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="session")
def http_server(media_files):
    """A real HTTP server on 127.0.0.1 in a thread; yields its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.files = {
        "image.png": media_files.png.read_bytes(),
        "big.bin": b"\0" * 200_000,
    }
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def loopback_is_public(monkeypatch):
    """Treat 127.0.0.1 as a public address, so the local test server can stand in for a public
    host while every other private address stays refused (to test redirect re-checks)."""
    original = remote.is_public_address
    loopback = ipaddress.ip_address("127.0.0.1")
    monkeypatch.setattr(remote, "is_public_address", lambda ip: ip == loopback or original(ip))
