"""Where media bytes come from: local paths, file://, data: and http(s), under a MediaPolicy."""

from __future__ import annotations

import base64
import os
import socket
import sys
from types import SimpleNamespace
from urllib.parse import quote

import pytest

from areno.errors import ConfigError
from areno.media import (
    MediaAccessDeniedError,
    MediaFetchError,
    MediaNotFoundError,
    MediaPolicy,
    MediaTooLargeError,
    is_loopback_host,
    load_media_bytes,
)
from areno.media.errors import describe_node

ANYWHERE = MediaPolicy.for_training()


def remote_policy(**kwargs) -> MediaPolicy:
    return MediaPolicy(allow_remote=True, allow_private_network=True, **kwargs)


# --- local files ------------------------------------------------------------------------------


def test_local_absolute_path(media_files):
    got = load_media_bytes(str(media_files.png), ANYWHERE)
    assert got.data == media_files.png.read_bytes()
    assert got.mime == "image/png"
    assert got.source == str(media_files.png)


def test_local_relative_path_is_relative_to_cwd(media_files, monkeypatch):
    monkeypatch.chdir(media_files.dir)
    got = load_media_bytes("image.png", ANYWHERE)
    assert got.data == media_files.png.read_bytes()


@pytest.mark.parametrize("prefix", ["file://", "file://localhost"])
def test_file_url(media_files, prefix):
    got = load_media_bytes(prefix + str(media_files.png), ANYWHERE)
    assert got.data == media_files.png.read_bytes()


def test_file_url_is_percent_decoded(tmp_path):
    path = tmp_path / "with space.png"
    path.write_bytes(b"abc")
    assert load_media_bytes("file://" + quote(str(path)), ANYWHERE).data == b"abc"


def fake_ray(*, initialized: bool = True, node_id: str | None = "ab12cd", ip: str = "10.1.2.3"):
    """A stand-in for the `ray` module as describe_node sees it (no cluster needed)."""

    def get_node_id():
        if node_id is None:
            raise RuntimeError("no node id here")
        return node_id

    return SimpleNamespace(
        is_initialized=lambda: initialized,
        get_runtime_context=lambda: SimpleNamespace(get_node_id=get_node_id),
        util=SimpleNamespace(get_node_ip_address=lambda: ip),
    )


def test_not_found_names_path_host_and_ray_node(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", fake_ray())
    with pytest.raises(MediaNotFoundError) as info:
        load_media_bytes(str(tmp_path / "gone.wav"), ANYWHERE)
    message = str(info.value)
    assert str(tmp_path / "gone.wav") in message
    assert f"node {socket.gethostname()!r} (Ray node ab12cd, ip 10.1.2.3)" in message


def test_unreadable_path_names_the_node(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", fake_ray())
    (tmp_path / "file.png").write_bytes(b"x")
    # A path "through" a regular file: stat fails with ENOTDIR, not "not found".
    with pytest.raises(MediaNotFoundError, match="cannot read media file") as info:
        load_media_bytes(str(tmp_path / "file.png" / "inner.png"), ANYWHERE)
    assert "Ray node ab12cd, ip 10.1.2.3" in str(info.value)


def test_describe_node_without_ray(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert describe_node() == f"node {socket.gethostname()!r}"
    assert "ray" not in sys.modules  # never imported just to describe the node


def test_describe_node_with_ray_not_initialized(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", fake_ray(initialized=False))
    assert describe_node() == f"node {socket.gethostname()!r}"


def test_describe_node_keeps_what_it_can_learn(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", fake_ray(node_id=None))
    assert describe_node() == f"node {socket.gethostname()!r} (ip 10.1.2.3)"


def test_allowed_root_accepts_files_inside(media_files):
    policy = MediaPolicy(allowed_local_media_paths=(str(media_files.dir),))
    assert load_media_bytes(str(media_files.png), policy).data


def test_allowed_root_refuses_dotdot_and_symlink_escape(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.png").write_bytes(b"secret")
    (root / "link.png").symlink_to(outside / "secret.png")
    policy = MediaPolicy(allowed_local_media_paths=(str(root),))
    for url in (f"{root}/../outside/secret.png", str(root / "link.png")):
        with pytest.raises(MediaAccessDeniedError, match="outside the allowed roots"):
            load_media_bytes(url, policy)


def test_allowed_root_is_not_a_string_prefix(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root-evil").mkdir()
    (tmp_path / "root-evil" / "a.png").write_bytes(b"x")
    policy = MediaPolicy(allowed_local_media_paths=(str(tmp_path / "root"),))
    with pytest.raises(MediaAccessDeniedError):
        load_media_bytes(str(tmp_path / "root-evil" / "a.png"), policy)


def test_symlinked_root_is_resolved(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a.png").write_bytes(b"x")
    os.symlink(tmp_path / "real", tmp_path / "alias")
    policy = MediaPolicy(allowed_local_media_paths=(str(tmp_path / "alias"),))
    assert load_media_bytes(str(tmp_path / "alias" / "a.png"), policy).data == b"x"


def test_local_file_over_byte_cap(media_files):
    policy = MediaPolicy(allowed_local_media_paths=("/",), max_bytes=100)
    with pytest.raises(MediaTooLargeError, match="over the limit of 100 bytes"):
        load_media_bytes(str(media_files.png), policy)


@pytest.mark.parametrize(
    ("host", "local_allowed"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.1.2.3", False),
        ("api.example.com", False),
    ],
)
def test_for_server_default(host, local_allowed):
    policy = MediaPolicy.for_server(host)
    assert (policy.allowed_local_media_paths == ("/",)) is local_allowed
    assert (policy.allowed_local_media_paths is None) is not local_allowed
    assert is_loopback_host(host) is local_allowed
    assert policy.allow_remote is False


def test_for_server_explicit_roots_win(tmp_path):
    policy = MediaPolicy.for_server("127.0.0.1", (str(tmp_path),))
    assert policy.allowed_local_media_paths == (os.path.realpath(tmp_path),)
    public = MediaPolicy.for_server("0.0.0.0", (str(tmp_path),))
    assert public.allowed_local_media_paths == (os.path.realpath(tmp_path),)


@pytest.mark.parametrize(
    "kwargs", [{"max_bytes": 0}, {"remote_timeout_s": 0}, {"max_redirects": -1}]
)
def test_policy_validation(kwargs):
    with pytest.raises(ConfigError):
        MediaPolicy(**kwargs)


# --- data: URLs -------------------------------------------------------------------------------


def test_data_url_base64(media_files):
    raw = media_files.png.read_bytes()
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    got = load_media_bytes(url, MediaPolicy(), expected_modality="image")
    assert got.data == raw
    assert got.mime == "image/png"
    assert got.source == f"data URL (image/png, {len(raw)} bytes)"


def test_data_url_percent_encoded():
    url = "data:audio/wav," + quote(bytes(range(256)), safe="")
    got = load_media_bytes(url, MediaPolicy(), expected_modality="audio")
    assert got.data == bytes(range(256))


def test_data_url_octet_stream_is_accepted_for_any_modality():
    url = "data:application/octet-stream;base64," + base64.b64encode(b"abc").decode()
    assert load_media_bytes(url, MediaPolicy(), expected_modality="video").data == b"abc"


def test_data_url_size_checked_before_decoding():
    url = "data:image/png;base64," + "A" * 4000
    with pytest.raises(MediaTooLargeError, match="over the limit of 1000 bytes"):
        load_media_bytes(url, MediaPolicy(max_bytes=1000))


# --- http(s):// -------------------------------------------------------------------------------


def test_remote_is_off_by_default(http_server):
    with pytest.raises(MediaAccessDeniedError, match="--allow-remote-media"):
        load_media_bytes(f"{http_server}/file/image.png", MediaPolicy())


def test_remote_private_address_refused_unless_allowed(http_server, media_files):
    url = f"{http_server}/file/image.png"
    with pytest.raises(MediaAccessDeniedError, match="--allow-private-media-urls"):
        load_media_bytes(url, MediaPolicy(allow_remote=True))
    got = load_media_bytes(url, remote_policy())
    assert got.data == media_files.png.read_bytes()
    assert got.mime == "application/octet-stream"
    assert got.source == url


def test_remote_source_hides_query(http_server):
    got = load_media_bytes(f"{http_server}/file/image.png?token=SECRET", remote_policy())
    assert "SECRET" not in got.source


def test_remote_redirect_chain_is_followed(http_server, media_files):
    got = load_media_bytes(f"{http_server}/redirect/3", remote_policy(max_redirects=3))
    assert got.data == media_files.png.read_bytes()


def test_remote_too_many_redirects(http_server):
    with pytest.raises(MediaFetchError, match="max_redirects=2"):
        load_media_bytes(f"{http_server}/redirect/3", remote_policy(max_redirects=2))


def test_remote_redirect_to_file_scheme_refused(http_server):
    with pytest.raises(MediaAccessDeniedError, match="only redirects to http"):
        load_media_bytes(f"{http_server}/to?url=file:///etc/passwd", remote_policy())


def test_remote_redirect_to_private_address_rechecked(http_server, loopback_is_public):
    # The first hop is allowed (127.0.0.1 plays a public host); the redirect target is not.
    policy = MediaPolicy(allow_remote=True)
    assert load_media_bytes(f"{http_server}/file/image.png", policy).data
    with pytest.raises(MediaAccessDeniedError, match="169.254.169.254"):
        load_media_bytes(f"{http_server}/to?url=http://169.254.169.254/latest/", policy)


def test_remote_dns_answer_is_checked_at_connect(monkeypatch):
    # A name whose DNS answer is private (what a rebinding attack returns) is refused by the
    # connection itself, not by an earlier look-up that could have seen another answer.
    import socket

    def fake_getaddrinfo(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", port))]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    with pytest.raises(MediaAccessDeniedError, match="10.0.0.7"):
        load_media_bytes("http://rebind.example/a.png", MediaPolicy(allow_remote=True))


@pytest.mark.parametrize("route", ["file", "nolength"])
def test_remote_byte_cap(http_server, route):
    with pytest.raises(MediaTooLargeError, match="100000 bytes"):
        load_media_bytes(f"{http_server}/{route}/big.bin", remote_policy(max_bytes=100_000))


def test_remote_without_content_length_within_cap(http_server, media_files):
    got = load_media_bytes(f"{http_server}/nolength/image.png", remote_policy())
    assert got.data == media_files.png.read_bytes()


@pytest.mark.parametrize("route", ["slow", "drip"])
def test_remote_timeout(http_server, route):
    with pytest.raises(MediaFetchError, match=r"timed out after 0.3s"):
        load_media_bytes(f"{http_server}/{route}", remote_policy(remote_timeout_s=0.3))


def test_remote_http_error_status(http_server):
    with pytest.raises(MediaFetchError, match="HTTP 503"):
        load_media_bytes(f"{http_server}/status/503", remote_policy())


def test_https_goes_through_the_checked_connection(http_server):
    https = http_server.replace("http://", "https://")
    with pytest.raises(MediaAccessDeniedError, match="--allow-private-media-urls"):
        load_media_bytes(f"{https}/file/image.png", MediaPolicy(allow_remote=True))
    # Allowed to connect, the TLS handshake with a plain-HTTP server fails cleanly.
    with pytest.raises(MediaFetchError):
        load_media_bytes(f"{https}/file/image.png", remote_policy())
