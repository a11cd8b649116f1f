"""Hostile requests against a live `areno serve` app: every one gets the right 4xx with an OpenAI
error body naming the cause, and the server keeps serving with bounded memory afterwards.

One Ray Serve app (tiny Gemma 4) serves the whole module, configured as a hardened deployment
would be: an API key, one allowed local media root, remote media on, private networks off,
--max-prompt-tokens. Two loopback HTTP servers stand in for the outside world: 127.0.0.1 (a
private address the app must refuse) and 127.0.0.2, which every Ray worker of tests/serve/live
treats as a public host (`apps.public_stand_in`, a worker setup hook), so a redirect from an
allowed-looking server to loopback is tested end to end.

`CASES` (tests/serve/live/hostile_cases.py) is the table; docs/hostile-inputs.md is generated
from it (`ARENO_UPDATE_DOCS=1 pytest tests/serve/live/test_hostile_inputs.py -k doc`).
"""

from __future__ import annotations

import base64
import dataclasses
import glob
import http.client
import http.server
import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import ray

from areno.engine.config import EngineConfig
from areno.serve.config import ServeConfig
from tests.media.conftest import _Handler as MediaHTTPHandler
from tests.serve.live.apps import PUBLIC_STAND_IN, deployed
from tests.serve.live.hostile_cases import CASES
from tests.serve.live.hostile_media import SECRET, png_with_text, write_hostile_files
from tests.serve.live.hostile_requests import (
    API_KEY,
    MODEL,
    UNSUPPORTED_VALUES,
    WRONG_TYPES,
    Case,
    Req,
    chat,
    data_url,
    media,
)

APP = "hostile"
MAX_PROMPT_TOKENS = 900
MAX_CONTEXT_LEN = 2048
MAX_RSS_GROWTH = 1536 * 1024 * 1024  # all app processes together, after the whole table
DOC = Path(__file__).resolve().parents[3] / "docs" / "hostile-inputs.md"
MiB = 1024 * 1024


# --- the live server ---------------------------------------------------------------------------


def _http_server(host: str, files: dict[str, bytes]):
    httpd = http.server.ThreadingHTTPServer((host, 0), MediaHTTPHandler)
    httpd.daemon_threads = True
    httpd.files = files
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    return httpd, thread


def _app_processes() -> list:
    """This session's replica processes of the app and Serve's HTTP proxy (which buffers request
    bodies): the raylet's children with those process titles."""
    node = ray._private.worker._global_node
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    found = []
    for process in raylet.children():
        title = " ".join(process.cmdline())
        if f"ServeReplica:{APP}:" in title or "ProxyActor" in title:
            found.append(process)
    return found


def _total_rss(processes: list) -> int:
    return sum(p.memory_info().rss for p in processes if p.is_running())


@pytest.fixture(scope="module")
def ctx(serve_port, tiny_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-root")
    outside = tmp_path_factory.mktemp("hostile-outside")
    paths = write_hostile_files(root, outside)
    files = {name: path.read_bytes() for name, path in paths.items() if path.stat().st_size < MiB}
    served = {"image.png": files["image.png"]}
    loopback, loopback_thread = _http_server("127.0.0.1", served)
    public, public_thread = _http_server(PUBLIC_STAND_IN, served)

    config = ServeConfig(
        model_path=str(tiny_path("gemma4")),
        served_model_name=MODEL,
        port=serve_port,
        api_key=API_KEY,
        engine=EngineConfig(max_running_prompts=2, max_context_len=MAX_CONTEXT_LEN),
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        allowed_local_media_paths=(str(root),),
        allow_remote_media=True,
    )
    try:
        with deployed((APP, "/", config)):
            loopback_port = loopback.server_address[1]
            yield SimpleNamespace(
                port=serve_port,
                root=str(root),
                outside=str(outside),
                outside_name=outside.name,
                files=files,
                loopback=f"http://127.0.0.1:{loopback_port}",
                loopback_port=loopback_port,
                public=f"http://{PUBLIC_STAND_IN}:{public.server_address[1]}",
                baseline_rss={},
            )
    finally:
        for httpd, thread in ((loopback, loopback_thread), (public, public_thread)):
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=10)


def _fill(value: Any, ctx) -> Any:
    """`{root}`-style names in every string of a JSON body, from the context."""
    if isinstance(value, str):
        return re.sub(r"\{(\w+)\}", lambda m: str(getattr(ctx, m.group(1), m.group(0))), value)
    if isinstance(value, list):
        return [_fill(v, ctx) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, ctx) for k, v in value.items()}
    return value


def _as_request(spec: Any, ctx) -> Req:
    spec = spec(ctx) if callable(spec) else spec
    if isinstance(spec, Req):
        return dataclasses.replace(spec, json=_fill(spec.json, ctx))
    return Req(json=_fill(spec, ctx))


def _send_raw(ctx, data: bytes) -> tuple[int, dict]:
    """Write `data` to a fresh connection and read one response (the server must answer
    without waiting for the rest of a declared body)."""
    with socket.create_connection(("127.0.0.1", ctx.port), timeout=60) as sock:
        sock.sendall(data)
        response = b""
        while b"\r\n\r\n" not in response or not _complete(response):
            chunk = sock.recv(65536)
            if not chunk:
                break
            response += chunk
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


def _complete(response: bytes) -> bool:
    head, _, body = response.partition(b"\r\n\r\n")
    match = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
    return match is not None and len(body) >= int(match.group(1))


def send(ctx, request: Req) -> tuple[int, dict]:
    if request.raw is not None:
        return _send_raw(ctx, request.raw)
    headers = {"Authorization": f"Bearer {API_KEY}"} if request.auth else {}
    headers.update(request.headers)
    content = request.body if request.json is None else json.dumps(request.json).encode()
    connection = http.client.HTTPConnection("127.0.0.1", ctx.port, timeout=120)
    try:
        connection.request(request.method, request.path, body=content, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def ok_request(ctx, content: Any = "Still there?") -> dict:
    status, body = send(ctx, Req(json=_fill(chat(content), ctx)))
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def warm(ctx):
    """One successful media request first (lazy imports, caches), then the RSS baseline."""
    ok_request(ctx, media("image", "{root}/image.png"))
    processes = _app_processes()
    assert any("Ingress" in " ".join(p.cmdline()) for p in processes), processes
    ctx.baseline_rss = {p.pid: p.memory_info().rss for p in processes}
    return ctx


# --- the tests ---------------------------------------------------------------------------------


def test_the_table_is_big_and_ids_are_unique():
    from areno.protocol import ChatCompletionRequest
    from areno.protocol.chat import UNSUPPORTED_FIELDS

    assert len({case.id for case in CASES}) == len(CASES) >= 50
    assert set(UNSUPPORTED_VALUES) == set(UNSUPPORTED_FIELDS)
    # every field is covered: a wrong type for each implemented one, a value for each refused one
    assert set(WRONG_TYPES) | set(UNSUPPORTED_VALUES) == set(ChatCompletionRequest.model_fields)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_hostile_request(warm, case: Case):
    status, body = send(warm, _as_request(case.request, warm))
    error = body.get("error") if isinstance(body, dict) else None
    assert status == case.status, body
    assert isinstance(error, dict) and set(error) >= {"message", "type", "code", "param"}, body
    assert error["code"] == case.code, body
    assert isinstance(error["message"], str) and error["message"], body
    for needle in case.needles:
        assert _fill(needle, warm) in error["message"], error["message"]
    if case.param is not None:
        assert error["param"] == case.param, error
    assert SECRET.decode() not in json.dumps(body)
    assert API_KEY not in json.dumps(body)


def test_still_serving_with_bounded_memory(warm):
    """After the whole table: normal requests still succeed (text, a local image, an image
    from the public stand-in) and the app's processes hold little more memory than before."""
    ok_request(warm)
    ok_request(warm, media("image", "{root}/image.png"))
    ok_request(warm, media("image", "{public}/file/image.png"))
    processes = [p for p in _app_processes() if p.pid in warm.baseline_rss]
    growth = _total_rss(processes) - sum(warm.baseline_rss[p.pid] for p in processes)
    print(f"RSS of {len(processes)} app processes grew by {growth / MiB:.0f} MiB")
    assert growth < MAX_RSS_GROWTH, f"app processes grew by {growth / MiB:.0f} MiB"


def test_the_workers_answered_every_refusal_without_a_failed_request(warm):
    """After the whole table: the worker replicas answered each refusal (a missing file, an
    undecodable codec, a prompt over the limits) as a Refused value, so none of them logged a
    failed request with its traceback, as Serve does for an exception a replica raises."""
    session = ray._private.worker._global_node.get_session_dir_path()
    for deployment in ("MediaDecoderServer", "ProcessorServer", "GeneratorServer"):
        logs = _read_logs(f"{session}/logs/serve/replica_{APP}_{deployment}_*")
        assert logs and b"Request failed" not in logs, deployment


def test_logs_hold_no_key_private_metadata_or_media_bytes(warm):
    """A request with a media file, private metadata and the API key, under
    ARENO_LOG_COMPLETIONS=1: once its completion is logged, no log file of the session holds
    the key, the metadata value, the media bytes, or the secret content of the files the
    hostile cases pointed at."""
    marker = "ARENO-MEDIA-MARKER-51c2"
    png = png_with_text(marker)
    private = "PRIVATE-METADATA-VALUE-9d41"
    content = media("image", data_url("image/png", png))
    status, body = send(warm, Req(json=chat(content, metadata={"answer": private}, user=private)))
    assert status == 200, body
    session = ray._private.worker._global_node.get_session_dir_path()
    deadline = time.monotonic() + 30
    while body["id"].encode() not in _read_logs(f"{session}/logs/serve/replica_{APP}_Ingress_*"):
        assert time.monotonic() < deadline, "ARENO_LOG_COMPLETIONS=1 logged no completion"
        time.sleep(0.2)
    logs = _read_logs(f"{session}/logs/**/*")
    for needle in (API_KEY, private, marker, base64.b64encode(png[16:64]).decode()):
        assert needle.encode() not in logs, needle
    assert SECRET not in logs


def _read_logs(pattern: str) -> bytes:
    paths = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
    return b"".join(Path(p).read_bytes() for p in paths)


def test_default_bind_address_is_loopback():
    """`areno serve` and ServeConfig bind loopback unless told otherwise, and only a loopback
    bind lets clients name arbitrary local files."""
    from areno.cli import build_parser
    from areno.media import MediaPolicy, is_loopback_host

    args = build_parser().parse_args(["serve", "--model-path", "/m"])
    assert args.host == ServeConfig(model_path="/m").host == "127.0.0.1"
    assert is_loopback_host(args.host)
    assert MediaPolicy.for_server("0.0.0.0").allowed_local_media_paths is None


# --- the doc -----------------------------------------------------------------------------------


def render_doc() -> str:
    lines = [
        "# Hostile inputs",
        "",
        "Every row is a request a test sends to a live `areno serve` app "
        "(`tests/serve/live/test_hostile_inputs.py`, tiny Gemma 4 checkpoint, an API key, one "
        "allowed local media root, remote media on and private networks off, "
        "`--max-prompt-tokens 900`, `--max-context-len 2048`, 2 cache slots). Each must be "
        "answered with the status below and "
        'an OpenAI error body (`{"error": {"message", "type", "param", "code"}}`) whose '
        "message names the cause; after the whole table the server still answers normal "
        "requests and its processes' memory has stayed bounded. `<root>` is the allowed media "
        "root, `<outside>` a directory next to it.",
        "",
        "This file is generated from the test's table: after changing it run "
        "`ARENO_UPDATE_DOCS=1 pytest tests/serve/live/test_hostile_inputs.py -k doc`.",
        "",
        f"{len(CASES)} cases.",
        "",
        "| case | category | input | status | error code |",
        "| --- | --- | --- | --- | --- |",
    ]
    for case in CASES:
        what = case.what.replace("|", "\\|")
        lines.append(f"| `{case.id}` | {case.category} | {what} | {case.status} | `{case.code}` |")
    return "\n".join(lines) + "\n"


def test_doc_lists_every_case():
    expected = render_doc()
    if os.environ.get("ARENO_UPDATE_DOCS") == "1":
        DOC.write_text(expected)
    current = DOC.read_text() if DOC.exists() else ""
    assert current == expected, (
        "docs/hostile-inputs.md is out of date: run "
        "ARENO_UPDATE_DOCS=1 pytest tests/serve/live/test_hostile_inputs.py -k doc"
    )
