"""A small stdlib HTTP(S) fetcher that cannot be steered into private networks.

No proxy, no automatic redirects, no decompression: each hop is re-checked (scheme and address),
the address check runs on the socket actually connected, and the body is read under a byte cap
and an overall deadline.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from areno.media.errors import (
    FLAG_PRIVATE_URLS,
    InvalidMediaURLError,
    MediaAccessDeniedError,
    MediaFetchError,
    MediaTooLargeError,
)

_REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_CHUNK_BYTES = 64 * 1024
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


@dataclass(frozen=True)
class FetchLimits:
    timeout_s: float
    max_bytes: int
    max_redirects: int
    allow_private_network: bool


def fetch_url(url: str, limits: FetchLimits) -> tuple[bytes, str | None]:
    """GET `url`, following at most `limits.max_redirects` redirects; returns (body, mime)."""
    deadline = time.monotonic() + limits.timeout_s
    current = url
    for _ in range(limits.max_redirects + 1):
        conn = _open_connection(current, limits)
        try:
            response = _request(conn, current, limits)
            if response.status in _REDIRECT_STATUSES:
                current = _redirect_target(current, response)
                continue
            if response.status != 200:
                raise MediaFetchError(
                    f"fetching {redact_url(current)} failed: HTTP {response.status} "
                    f"{response.reason}"
                )
            data = _read_body(response, current, limits, deadline)
            mime = (response.getheader("Content-Type") or "").split(";")[0].strip() or None
            return data, mime
        finally:
            conn.close()
    raise MediaFetchError(
        f"fetching {redact_url(url)} took more than max_redirects={limits.max_redirects} redirects"
    )


def redact_url(url: str) -> str:
    """The URL without query or credentials (they may hold signed tokens), for messages."""
    parts = urlsplit(url)
    try:
        host, port = parts.hostname or "", parts.port
    except ValueError:
        host, port = parts.netloc.rpartition("@")[2], None
    netloc = f"[{host}]" if ":" in host else host
    if port:
        netloc += f":{port}"
    text = f"{parts.scheme}://{netloc}{parts.path}"
    return text if len(text) <= 120 else text[:117] + "..."


def is_public_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether `ip` is a globally routable unicast address (not loopback/private/link-local...)."""
    if isinstance(ip, ipaddress.IPv6Address):
        # IPv4 embedded in IPv6 (mapped, 6to4, NAT64, Teredo) reaches the IPv4 address inside.
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None and not is_public_address(embedded):
            return False
    return ip.is_global and not (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


def _redirect_target(current: str, response: http.client.HTTPResponse) -> str:
    location = response.getheader("Location")
    if not location:
        raise MediaFetchError(f"{redact_url(current)} redirected without a Location header")
    target = urljoin(current, location)
    if urlsplit(target).scheme.lower() not in ("http", "https"):
        raise MediaAccessDeniedError(
            f"{redact_url(current)} redirected to {redact_url(target)}; only redirects to "
            "http(s) URLs are followed"
        )
    return target


def _open_connection(url: str, limits: FetchLimits) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise InvalidMediaURLError(f"media URL {redact_url(url)} is malformed: {exc}") from None
    if not host:
        raise InvalidMediaURLError(f"media URL {redact_url(url)} has no host")
    https = parts.scheme.lower() == "https"
    # Always pass the port: given none, http.client re-parses `host` and misreads IPv6 literals.
    port = port or (443 if https else 80)
    if https:
        conn = _CheckedHTTPSConnection(
            host, port, timeout=limits.timeout_s, context=ssl.create_default_context()
        )
    else:
        conn = _CheckedHTTPConnection(host, port, timeout=limits.timeout_s)
    conn.allow_private_network = limits.allow_private_network
    return conn


def _request(
    conn: http.client.HTTPConnection, url: str, limits: FetchLimits
) -> http.client.HTTPResponse:
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        conn.request("GET", target, headers={"User-Agent": "areno", "Accept-Encoding": "identity"})
        return conn.getresponse()
    except TimeoutError:
        raise _timed_out(url, limits) from None
    except (OSError, http.client.HTTPException) as exc:
        raise MediaFetchError(f"fetching {redact_url(url)} failed: {exc}") from None


def _read_body(
    response: http.client.HTTPResponse, url: str, limits: FetchLimits, deadline: float
) -> bytes:
    length = response.getheader("Content-Length")
    if length and length.isdigit():
        _check_size(int(length), url, limits)
    chunks, total = [], 0
    try:
        # read1 returns what has arrived, so the deadline is checked even on a slow drip.
        while chunk := response.read1(_CHUNK_BYTES):
            total += len(chunk)
            _check_size(total, url, limits)  # servers may lie about or omit Content-Length
            if time.monotonic() > deadline:
                raise TimeoutError
            chunks.append(chunk)
    except TimeoutError:
        raise _timed_out(url, limits) from None
    except (OSError, http.client.HTTPException) as exc:
        raise MediaFetchError(f"reading {redact_url(url)} failed: {exc}") from None
    return b"".join(chunks)


def _check_size(num_bytes: int, url: str, limits: FetchLimits) -> None:
    if num_bytes > limits.max_bytes:
        raise MediaTooLargeError(
            f"media {redact_url(url)} is over the limit of {limits.max_bytes} bytes "
            f"(got at least {num_bytes} bytes)"
        )


def _timed_out(url: str, limits: FetchLimits) -> MediaFetchError:
    return MediaFetchError(f"fetching {redact_url(url)} timed out after {limits.timeout_s}s")


def _connect_checked(
    host: str, port: int, timeout: float | None, allow_private: bool
) -> socket.socket:
    """Resolve `host`, refuse non-public addresses, and connect to exactly the checked address."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise MediaFetchError(f"cannot resolve media host {host!r}: {exc}") from None
    addresses = [(info, ipaddress.ip_address(info[4][0].split("%")[0])) for info in infos]
    for _, ip in addresses:
        # Any non-public answer refuses the host: a name that mixes public and private
        # addresses is exactly what a rebinding attack looks like.
        if not allow_private and not is_public_address(ip):
            raise MediaAccessDeniedError(
                f"media host {host!r} resolves to {ip}, a private, loopback, link-local or "
                f"reserved address; start the server with {FLAG_PRIVATE_URLS} to allow it"
            )
    error: OSError | None = None
    for (family, kind, proto, _, sockaddr), _ in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error or OSError(f"no address for {host!r}")


class _CheckedHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection whose socket goes only to an address the policy allows.

    NOTE: the check runs at connect time on the address actually connected to, so a DNS answer
    that changes between a check and the connection (rebinding) cannot slip through.
    """

    allow_private_network = False

    def connect(self) -> None:
        self.sock = _connect_checked(self.host, self.port, self.timeout, self.allow_private_network)


class _CheckedHTTPSConnection(http.client.HTTPSConnection, _CheckedHTTPConnection):
    """HTTPS on top of the checked socket.

    The MRO makes `HTTPSConnection.connect` call `_CheckedHTTPConnection.connect` for the TCP
    socket, then wrap it in TLS with `server_hostname` = the URL's host, so the certificate is
    still verified for the name, not the IP.
    """
