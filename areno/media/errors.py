"""Media errors: each names its cause and what the user can do about it.

All derive from `MediaError`, itself an `ArenoError`, so the serving layer answers them with a
4xx and the request's other parts are never touched.
"""

from __future__ import annotations

import contextlib
import socket
import sys

from areno.errors import ArenoError

# Flags the server exposes; named in messages so a refused user knows which switch to ask for.
FLAG_LOCAL_PATHS = "--allowed-local-media-path"
FLAG_REMOTE = "--allow-remote-media"
FLAG_PRIVATE_URLS = "--allow-private-media-urls"


class MediaError(ArenoError):
    """A media item could not be loaded or decoded."""

    code = "invalid_media"


class MediaNotFoundError(MediaError):
    """A local media file does not exist (or is not a regular file) on the node that looked."""

    code = "media_not_found"


class MediaAccessDeniedError(MediaError):
    """The media policy refuses this source: a path outside the roots, remote fetching off,
    a private address, a redirect to another scheme."""

    status_code = 403
    code = "media_access_denied"


class MediaFetchError(MediaError):
    """A remote fetch failed: HTTP status, timeout, connection error, too many redirects."""

    code = "media_fetch_failed"


class InvalidMediaURLError(MediaError):
    """The media URL is malformed (a data URL without a comma, bad base64, no host)."""

    code = "invalid_media_url"


class MediaDecodeError(MediaError):
    """The bytes could not be decoded as the requested modality."""

    code = "media_decode_failed"


class MissingFrameRateError(MediaDecodeError):
    """A video stream carries no usable frame-rate metadata, so frames cannot be timed."""

    code = "video_missing_frame_rate"


class MediaTooLargeError(MediaError):
    """A size limit was hit: bytes, pixels, duration."""

    status_code = 413
    code = "media_too_large"


class UnsupportedMediaTypeError(MediaError):
    """Unknown MIME type or URL scheme, or a MIME type that does not match the modality."""

    status_code = 415
    code = "unsupported_media_type"


def describe_node() -> str:
    """The node doing the work, for "not found" / "cannot read" messages.

    Outside Ray: `node 'HOST'`. In a Ray worker (or a driver connected to Ray):
    `node 'HOST' (Ray node NODE_ID, ip IP)`, so an error raised on one node of a cluster says
    which one looked. Ray is looked up in `sys.modules` rather than imported: inside a Ray
    worker it is already loaded, and outside one importing it would only cost time to learn
    nothing (the media layer never requires Ray).
    """
    text = f"node {socket.gethostname()!r}"
    ray = sys.modules.get("ray")
    if ray is None or not _ray_is_initialized(ray):
        return text
    # NOTE: best-effort diagnostics; nothing here may mask the error being reported.
    details = []
    with contextlib.suppress(Exception):
        details.append(f"Ray node {ray.get_runtime_context().get_node_id()}")
    with contextlib.suppress(Exception):
        details.append(f"ip {ray.util.get_node_ip_address()}")
    return f"{text} ({', '.join(details)})" if details else text


def _ray_is_initialized(ray) -> bool:
    try:
        return bool(ray.is_initialized())
    except Exception:
        return False


def decode_error(
    what: str, source: str, reason: str, *, container: str | None = None, codec: str | None = None
) -> MediaDecodeError:
    """A `MediaDecodeError` naming the source, the detected container/codec and the remedy."""
    found = [f"container {container}" if container else "", f"codec {codec}" if codec else ""]
    detail = f" [{', '.join(part for part in found if part)}]" if any(found) else ""
    return MediaDecodeError(
        f"could not decode {what} from {source}{detail}: {reason}. Check that the file opens in "
        f"the same Python environment (Pillow / soundfile / PyAV), or re-encode it to a common "
        f"format (PNG/JPEG, WAV/FLAC, H.264 MP4)."
    )
