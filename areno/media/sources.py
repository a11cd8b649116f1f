"""Where media bytes come from, and the policy that decides which sources are allowed.

Four kinds of URL are understood: a local path (absolute, or relative to the worker's cwd),
`file://`, `data:` and `http(s)://`. Every source is size-capped. Remote fetches are delegated to
`areno.media.remote`, whose connections check the address they actually connect to.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import mimetypes
import os
import re
import stat
from dataclasses import dataclass, field
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from areno.errors import ConfigError
from areno.media.errors import (
    FLAG_LOCAL_PATHS,
    FLAG_REMOTE,
    InvalidMediaURLError,
    MediaAccessDeniedError,
    MediaNotFoundError,
    MediaTooLargeError,
    UnsupportedMediaTypeError,
    describe_node,
)
from areno.media.remote import FetchLimits, fetch_url, redact_url
from areno.media.types import Modality

MiB = 1024 * 1024
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(frozen=True)
class MediaPolicy:
    """Which media sources a worker may read, and how much.

    `allowed_local_media_paths`: None refuses local files; `("/",)` allows anything the process
    can read. Roots are resolved (symlinks, `..`) once, here.
    """

    allowed_local_media_paths: tuple[str, ...] | None = None
    allow_remote: bool = False
    allow_private_network: bool = False
    remote_timeout_s: float = 10.0
    max_bytes: int = 256 * MiB
    max_redirects: int = 3

    def __post_init__(self) -> None:
        if self.allowed_local_media_paths is not None:
            if isinstance(self.allowed_local_media_paths, str):
                raise ConfigError("allowed_local_media_paths must be a tuple of paths, not a str")
            roots = tuple(os.path.realpath(p) for p in self.allowed_local_media_paths)
            object.__setattr__(self, "allowed_local_media_paths", roots)
        if not self.remote_timeout_s > 0:
            raise ConfigError(f"remote_timeout_s must be > 0, got {self.remote_timeout_s}")
        if self.max_bytes < 1:
            raise ConfigError(f"max_bytes must be >= 1, got {self.max_bytes}")
        if self.max_redirects < 0:
            raise ConfigError(f"max_redirects must be >= 0, got {self.max_redirects}")

    @classmethod
    def for_server(
        cls, host: str, allowed_local_media_paths: tuple[str, ...] | None = None, **kwargs
    ) -> MediaPolicy:
        """The safe default for a server bound to `host`.

        Explicit roots win. Otherwise a loopback-bound server (only this machine can call it)
        may read any local file the process can, and a server on any other interface refuses
        local files, since its clients could otherwise read the server's disk.
        """
        if allowed_local_media_paths is None and is_loopback_host(host):
            allowed_local_media_paths = ("/",)
        return cls(allowed_local_media_paths=allowed_local_media_paths, **kwargs)

    @classmethod
    def for_training(cls, **kwargs) -> MediaPolicy:
        """Training reads its own datasets: local files anywhere, remote as configured."""
        return cls(allowed_local_media_paths=("/",), **kwargs)


@dataclass
class MediaBytes:
    """Raw bytes of one media item, before decoding."""

    data: bytes = field(repr=False)
    mime: str | None
    source: str  # short description for messages; never the bytes themselves


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a bind address or name) only accepts connections from this machine."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def load_media_bytes(
    url: str, policy: MediaPolicy, *, expected_modality: Modality | None = None
) -> MediaBytes:
    """Read the bytes `url` points at, enforcing `policy`."""
    if not url:
        raise InvalidMediaURLError("the media URL is empty")
    # Only the scheme is parsed here: urlsplit would copy a 300 MB data URL several times.
    match = _SCHEME.match(url)
    scheme = match.group(1).lower() if match else ""
    if scheme == "":
        return _load_local(url, url, policy)
    if scheme == "file":
        return _load_local(_file_url_path(url), url, policy)
    if scheme == "data":
        return _load_data_url(url, policy, expected_modality)
    if scheme in ("http", "https"):
        return _fetch_remote(url, policy)
    raise UnsupportedMediaTypeError(
        f"unsupported media URL scheme {scheme!r}; use a local path, file://, data: or http(s)://"
    )


# --- local files ------------------------------------------------------------------------------


def _file_url_path(url: str) -> str:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise UnsupportedMediaTypeError(
            f"file URL {url!r} names host {parts.netloc!r}; file:// URLs must be local "
            "(file:///abs/path or file://localhost/abs/path)"
        )
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise InvalidMediaURLError(
            f"file URL {url!r} must hold an absolute path (file:///abs/path)"
        )
    return path


def _load_local(path: str, shown: str, policy: MediaPolicy) -> MediaBytes:
    roots = policy.allowed_local_media_paths
    shown = shown if len(shown) <= 200 else shown[:197] + "..."
    if "\x00" in path:
        raise InvalidMediaURLError(f"media path {shown!r} contains a NUL byte")
    if roots is None:
        raise MediaAccessDeniedError(
            f"local media files are disabled on this server, so {shown!r} was refused; start it "
            f"with {FLAG_LOCAL_PATHS} DIR to allow files under DIR"
        )
    # NOTE: resolve symlinks and `..` BEFORE the root check, so neither can escape a root. The
    # existence check comes after it, so refused paths do not reveal whether a file exists.
    real = os.path.realpath(path)
    if not any(real == root or real.startswith(root.rstrip("/") + "/") for root in roots):
        raise MediaAccessDeniedError(
            f"local media path {shown!r} resolves to {real!r}, outside the allowed roots "
            f"{list(roots)}; add its directory with {FLAG_LOCAL_PATHS}"
        )
    where = f"on {describe_node()}"
    try:
        info = os.stat(real)
    except FileNotFoundError:
        raise MediaNotFoundError(
            f"media file not found: {shown!r} (resolved to {real!r}) {where}, cwd {os.getcwd()!r}. "
            "Local paths are read by the worker that decodes them: put the file on that node "
            "(or on shared storage mounted at the same path on every node), or send it as a "
            "data: URL"
        ) from None
    except OSError as exc:
        raise MediaNotFoundError(f"cannot read media file {shown!r} {where}: {exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise MediaNotFoundError(f"media path {shown!r} {where} is a directory, not a file")
    # A FIFO or device would block or never end; only regular files are media.
    if not stat.S_ISREG(info.st_mode):
        raise MediaNotFoundError(f"media path {shown!r} {where} is not a regular file")
    _check_size(info.st_size, policy, shown)
    try:
        with open(real, "rb") as f:
            data = f.read(policy.max_bytes + 1)
    except OSError as exc:
        raise MediaNotFoundError(f"cannot read media file {shown!r} {where}: {exc}") from None
    _check_size(len(data), policy, shown)  # the file may have grown since stat
    return MediaBytes(data=data, mime=mimetypes.guess_type(real)[0], source=shown)


def _check_size(num_bytes: int, policy: MediaPolicy, shown: str) -> None:
    if num_bytes > policy.max_bytes:
        raise MediaTooLargeError(
            f"media {shown!r} is {num_bytes} bytes, over the limit of {policy.max_bytes} bytes "
            f"({policy.max_bytes / MiB:.0f} MiB)"
        )


# --- data: URLs -------------------------------------------------------------------------------


def _load_data_url(url: str, policy: MediaPolicy, expected: Modality | None) -> MediaBytes:
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise InvalidMediaURLError("data URL has no ',' separating the header from the data")
    params = [p.strip() for p in header.split(";")]
    is_base64 = params[-1].lower() == "base64"
    mime = params[0].lower()
    if "/" not in mime:
        raise UnsupportedMediaTypeError(
            f"data URL {header[:40]!r} has no MIME type; write it as data:<type>/<subtype>;base64,"
            "... (e.g. data:image/png;base64,...)"
        )
    _check_mime(mime, expected)
    # Check the encoded length first, so an oversized URL is refused before it is decoded.
    estimate = len(payload) * 3 // 4 if is_base64 else len(payload) // 3
    shown = f"data URL ({mime}, {len(payload)} encoded bytes)"
    _check_size(estimate, policy, shown)
    if is_base64:
        try:
            data = base64.b64decode(unquote(payload) if "%" in payload else payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidMediaURLError(
                f"data URL ({mime}) holds invalid base64 ({exc}); encode the bytes with standard "
                "base64 (base64.b64encode), without line breaks"
            ) from None
    else:
        data = unquote_to_bytes(payload)
    shown = f"data URL ({mime}, {len(data)} bytes)"
    _check_size(len(data), policy, shown)
    return MediaBytes(data=data, mime=mime, source=shown)


def _check_mime(mime: str, expected: Modality | None) -> None:
    if expected is None or mime == "application/octet-stream":
        return
    if mime.split("/", 1)[0] != expected:
        raise UnsupportedMediaTypeError(
            f"a data URL of type {mime!r} was given as {expected}; {expected} data URLs need a "
            f"{expected}/* MIME type (or application/octet-stream)"
        )


def _fetch_remote(url: str, policy: MediaPolicy) -> MediaBytes:
    if not policy.allow_remote:
        raise MediaAccessDeniedError(
            f"remote media URLs are disabled, so {redact_url(url)} was refused; start the server "
            f"with {FLAG_REMOTE} to fetch http(s) URLs"
        )
    limits = FetchLimits(
        timeout_s=policy.remote_timeout_s,
        max_bytes=policy.max_bytes,
        max_redirects=policy.max_redirects,
        allow_private_network=policy.allow_private_network,
    )
    data, mime = fetch_url(url, limits)
    return MediaBytes(data=data, mime=mime, source=redact_url(url))
