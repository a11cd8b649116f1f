"""Replica crashes under load on a live `areno serve` app: a Generator or MediaDecoder replica
killed (`ray.kill`) while requests are in flight, or the engine paused with mode "abort". Every
in-flight request must end with a clean OpenAI error (an error status with a JSON body, or an
error event that ends a started stream) — never a dropped connection, a hang or a reply that
looks complete — Ray Serve must start a replacement replica, and a new request must succeed
within a bounded time. The recovery time is measured and printed (the
figures go to docs/faults-and-load.md); the only timed assertion is a generous bound that turns
a hang into a failure.

One Serve app (tiny Gemma 4) serves the module, in the Ray instance of tests/serve/live
(conftest.py); the kills name this app's replicas only. The MediaDecoder's in-flight requests
are made deterministic with a loopback HTTP server that holds its image responses until the
replica is dead, so the decode is provably in progress when the kill lands.
"""

from __future__ import annotations

import asyncio
import http.server
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import ray
from ray import serve

from areno.engine.config import EngineConfig
from areno.engine.parallel.tp_executor import FOLLOWER_NAME_PREFIX
from areno.media.samples import write_image
from areno.serve.app import build_app
from areno.serve.config import ServeConfig
from tests.serve.live.apps import deployed

APP = "faults"
TP_APP = "faults-tp"
MODEL = "tiny-faults"
MAX_CONTEXT_LEN = 4096
LONG_TOKENS = 3000  # with ignore_eos: a request that is surely still decoding at the kill
# Generous bounds that turn a hang into a failure; they are not speed claims.
END_LIMIT_S = 60.0
RECOVERY_LIMIT_S = 180.0
# What a request held by a dying replica gets: 503, retryable (areno.serve.errors).
LOST = (503, "replica_unavailable")


class _HeldMedia(http.server.BaseHTTPRequestHandler):
    """GET /held.png: counts the request, then holds the response until `release` is set, so
    the MediaDecoder replica fetching it is busy for as long as the test wants."""

    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        server = self.server
        with server.lock:
            server.num_waiting += 1
        server.release.wait(RECOVERY_LIMIT_S)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(server.body)))
        self.end_headers()
        self.wfile.write(server.body)

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Outcome:
    """How one request ended: "ok", "status" (an HTTP error with an OpenAI JSON body),
    "stream_error" (an error event after the stream began) or "dirty" (a dropped connection,
    a timeout, a body that is not an OpenAI error: anything a client cannot act on)."""

    kind: str
    status: int | None = None
    code: str | None = None
    detail: str = ""
    retry_after: str | None = None  # the Retry-After header of an error status


@pytest.fixture(scope="module")
def app(serve_port, tiny_path, tmp_path_factory):
    media_dir = tmp_path_factory.mktemp("fault-media")
    image = write_image(media_dir / "small.png", 64, 48)
    held = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HeldMedia)
    held.daemon_threads = True
    held.lock, held.num_waiting = threading.Lock(), 0
    held.release, held.body = threading.Event(), image.read_bytes()
    held_thread = threading.Thread(target=held.serve_forever, args=(0.05,), daemon=True)
    held_thread.start()

    config = ServeConfig(
        model_path=str(tiny_path("gemma4")),
        served_model_name=MODEL,
        port=serve_port,
        engine=EngineConfig(max_running_prompts=2, max_context_len=MAX_CONTEXT_LEN),
        allow_remote_media=True,
        allow_private_network_media=True,  # the held-media server is on loopback
    )
    try:
        with deployed((APP, "/", config)):
            try:
                yield SimpleNamespace(
                    base_url=f"http://127.0.0.1:{serve_port}/v1",
                    image=str(image),
                    held=held,
                    held_url=f"http://127.0.0.1:{held.server_address[1]}/held.png",
                )
            finally:
                held.release.set()  # no replica is left waiting on it when the app is deleted
    finally:
        held.shutdown()
        held.server_close()
        held_thread.join(timeout=10)


# --- helpers -----------------------------------------------------------------------------------


def _client(app) -> openai.AsyncOpenAI:
    # max_retries=0: the SDK would otherwise retry a 5xx and hide what the server answered.
    return openai.AsyncOpenAI(
        base_url=app.base_url, api_key="unused", max_retries=0, timeout=RECOVERY_LIMIT_S
    )


def _replica_names(deployment: str, app: str = APP) -> list[str]:
    """Names of the live replica actors of one deployment of the app (Serve names its
    replicas "SERVE_REPLICA::<app>#<deployment>#<id>" in the "serve" namespace)."""
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in named if a["name"].startswith(prefix))


def _kill_replica(deployment: str) -> str:
    (name,) = _replica_names(deployment)
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return name


async def _poll(condition: Callable[[], bool], what: str, limit_s: float = END_LIMIT_S) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {limit_s:.0f} s")
        await asyncio.sleep(0.05)


def _message(content: Any) -> list[dict]:
    return [{"role": "user", "content": content}]


async def _ask(client: openai.AsyncOpenAI, content: Any, **kwargs: Any) -> Outcome:
    """A non-streaming request and how it ended."""
    try:
        await client.chat.completions.create(
            model=MODEL, messages=_message(content), temperature=0, **kwargs
        )
    except openai.APIStatusError as error:
        return _status_outcome(error)
    except (openai.APIConnectionError, openai.APIError) as error:  # timeouts included
        return Outcome("dirty", detail=repr(error))
    return Outcome("ok", 200)


async def _ask_stream(
    client: openai.AsyncOpenAI, content: Any, started: asyncio.Event | None = None, **kwargs: Any
) -> Outcome:
    """A streaming request and how it ended; `started` is set at its first chunk."""
    began = False
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=_message(content), temperature=0, stream=True, **kwargs
        )
        async for _ in stream:
            if not began and started is not None:
                started.set()
            began = True
    except openai.APIStatusError as error:
        return _status_outcome(error)
    except openai.APIConnectionError as error:  # dropped connection or timeout: not clean
        return Outcome("dirty", detail=repr(error))
    except openai.APIError as error:  # the SDK raises an in-stream error event as APIError
        body = error.body if isinstance(error.body, dict) else {}
        kind = "stream_error" if began and body.get("message") else "dirty"
        return Outcome(kind, code=body.get("code"), detail=error.message)
    return Outcome("ok", 200)


def _status_outcome(error: openai.APIStatusError) -> Outcome:
    body = error.body if isinstance(error.body, dict) else {}
    clean_status = error.status_code < 500 or error.status_code == 503
    if clean_status and body.get("message") and body.get("type"):
        retry_after = error.response.headers.get("retry-after")
        return Outcome("status", error.status_code, body.get("code"), body["message"], retry_after)
    return Outcome("dirty", error.status_code, detail=repr(error))


@dataclass
class Recovery:
    """Seconds from the kill until Serve created the replacement replica (its death was
    noticed), and until a new request succeeded (the replacement was serving)."""

    replaced_s: float
    answered_s: float


async def _recover(
    ask: Callable[[], Awaitable[Outcome]],
    deployment: str,
    old: str,
    killed_at: float,
    app: str = APP,
) -> Recovery:
    """Send new requests until one succeeds (clean refusals in between are fine) while
    watching for the replacement replica."""
    replaced_at: list[float] = []

    async def watch() -> None:
        while not [name for name in _replica_names(deployment, app) if name != old]:
            await asyncio.sleep(0.05)
        replaced_at.append(time.monotonic())

    watcher = asyncio.create_task(watch())
    deadline = killed_at + RECOVERY_LIMIT_S
    while True:
        outcome = await asyncio.wait_for(ask(), timeout=max(deadline - time.monotonic(), 1))
        if outcome.kind == "ok":
            break
        assert outcome.kind == "status", outcome  # a refusal while restarting must be clean
        if time.monotonic() > deadline:
            raise TimeoutError(f"no successful request within {RECOVERY_LIMIT_S:.0f} s")
        await asyncio.sleep(0.1)
    answered_at = time.monotonic()
    await asyncio.wait_for(watcher, timeout=END_LIMIT_S)  # it served, so it exists
    return Recovery(replaced_at[0] - killed_at, answered_at - killed_at)


async def _ended(tasks: list[asyncio.Task]) -> list[Outcome]:
    """Every in-flight request's outcome; a request still open after END_LIMIT_S is a hang."""
    done, pending = await asyncio.wait(tasks, timeout=END_LIMIT_S)
    for task in pending:
        task.cancel()
    assert not pending, f"{len(pending)} in-flight requests hung after the replica was killed"
    return [task.result() for task in tasks]


def _report(what: str, outcomes: list[Outcome], recovery: Recovery) -> None:
    print(
        f"\n{what}: replacement created {recovery.replaced_s:.2f} s after the kill, "
        f"new requests succeed {recovery.answered_s:.2f} s after it; in-flight requests:"
    )
    for outcome in outcomes:
        print(f"  {outcome.kind} {outcome.status} {outcome.code}: {outcome.detail[:160]}")


# --- tests -------------------------------------------------------------------------------------


def test_a_pause_that_aborts_cuts_requests_off_visibly(app):
    """The Generator deployment paused with mode "abort" (through a Serve handle) while a
    stream is mid-decode and a non-streaming request runs: the stream raises in the openai
    client (an error event, not a quiet end), the other gets 503 with Retry-After, both saying
    the request was cut off by a pause; a request while paused is refused with 503, and after
    resume the server answers as before."""

    async def scenario() -> tuple[list[Outcome], Outcome, Outcome]:
        client = _client(app)
        long = {"max_tokens": LONG_TOKENS, "extra_body": {"ignore_eos": True}}
        handle = serve.get_deployment_handle("GeneratorServer", APP)
        started = asyncio.Event()
        tasks = [asyncio.create_task(_ask_stream(client, "Stream on.", started, **long))]
        await asyncio.wait_for(started.wait(), END_LIMIT_S)
        tasks.append(asyncio.create_task(_ask(client, "Whole answer.", **long)))
        deadline = time.monotonic() + END_LIMIT_S
        while (await handle.stats.remote())["num_running"] < 2:
            assert time.monotonic() < deadline, "the requests never reached the engine"
            await asyncio.sleep(0.05)
        await handle.pause.remote("abort")
        outcomes = await _ended(tasks)
        paused = await _ask(client, "Paused?", max_tokens=4)
        await handle.resume.remote()
        after = await _ask_stream(client, "Back again?", max_tokens=4)
        await client.close()
        return outcomes, paused, after

    (stream, whole), paused, after = asyncio.run(scenario())
    assert (stream.kind, stream.code) == ("stream_error", "request_aborted"), stream
    assert (whole.kind, whole.status, whole.code) == ("status", 503, "request_aborted"), whole
    assert whole.retry_after == "1"
    for outcome in (stream, whole):
        assert "cut off" in outcome.detail and "paused" in outcome.detail, outcome
    assert (paused.status, paused.code, paused.retry_after) == (503, "engine_unavailable", "1")
    assert after.kind == "ok"


def test_generator_replica_killed_mid_request(app):
    """Two streams mid-decode and two non-streaming requests (running or waiting in the
    replica) when the Generator replica dies: all four end cleanly, and Serve's replacement
    answers a new request."""

    async def scenario() -> tuple[list[Outcome], Recovery]:
        client = _client(app)
        long = {"max_tokens": LONG_TOKENS, "extra_body": {"ignore_eos": True}}
        handle = serve.get_deployment_handle("GeneratorServer", APP)
        started = [asyncio.Event(), asyncio.Event()]
        tasks = [
            asyncio.create_task(_ask_stream(client, f"Stream {i}.", started[i], **long))
            for i in range(2)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), END_LIMIT_S)
        tasks += [asyncio.create_task(_ask(client, f"Whole {i}.", **long)) for i in range(2)]

        async def held() -> int:
            stats = await handle.stats.remote()
            return stats["num_running"] + stats["num_waiting"]

        deadline = time.monotonic() + END_LIMIT_S
        while await held() < 4:  # every request has reached the engine
            assert time.monotonic() < deadline, "the requests never reached the engine"
            await asyncio.sleep(0.05)
        old = _kill_replica("GeneratorServer")
        killed_at = time.monotonic()
        outcomes = await _ended(tasks)
        recovery = await _recover(
            lambda: _ask(client, "Are you back?", max_tokens=4), "GeneratorServer", old, killed_at
        )
        await client.close()
        return outcomes, recovery

    outcomes, recovery = asyncio.run(scenario())
    _report("Generator replica killed", outcomes, recovery)
    # The streams had begun (an error event ends them); the others get the error status.
    assert [o.kind for o in outcomes] == ["stream_error"] * 2 + ["status"] * 2, outcomes
    assert all((o.status or 503, o.code) == LOST for o in outcomes), outcomes


def test_media_decoder_replica_killed_mid_decode(app):
    """Image requests whose media the MediaDecoder replica is fetching (the held server answers
    only after the kill) when the replica dies: they end cleanly, streaming or not, and the
    replacement decodes a new image request."""

    async def scenario() -> tuple[list[Outcome], Recovery]:
        client = _client(app)
        content = [
            {"type": "image_url", "image_url": {"url": app.held_url}},
            {"type": "text", "text": "What is this?"},
        ]
        tasks = [
            asyncio.create_task(_ask(client, content, max_tokens=4)),
            asyncio.create_task(_ask_stream(client, content, max_tokens=4)),
        ]
        # The replica fetches one image at a time: one request is in the fetch, the other waits
        # in the replica's queue; both are in flight there.
        await _poll(lambda: app.held.num_waiting >= 1, "the decoder never fetched the image")
        old = _kill_replica("MediaDecoderServer")
        killed_at = time.monotonic()
        app.held.release.set()
        outcomes = await _ended(tasks)
        image = [
            {"type": "image_url", "image_url": {"url": app.image}},
            {"type": "text", "text": "And this?"},
        ]
        recovery = await _recover(
            lambda: _ask(client, image, max_tokens=4), "MediaDecoderServer", old, killed_at
        )
        await client.close()
        return outcomes, recovery

    outcomes, recovery = asyncio.run(scenario())
    _report("MediaDecoder replica killed", outcomes, recovery)
    # Neither stream had begun (the Ingress answers after the first token): both get the
    # error status with its JSON body.
    assert all((o.kind, o.status, o.code) == ("status", *LOST) for o in outcomes), outcomes


def test_the_replacements_serve_streaming_and_text(app):
    """After both kills the app serves as before: a text stream and an image request."""

    async def scenario() -> list[Outcome]:
        client = _client(app)
        image = [
            {"type": "image_url", "image_url": {"url": app.image}},
            {"type": "text", "text": "Once more?"},
        ]
        outcomes = await asyncio.gather(
            _ask_stream(client, "Hello again.", max_tokens=8), _ask(client, image, max_tokens=8)
        )
        await client.close()
        return list(outcomes)

    assert [o.kind for o in asyncio.run(scenario())] == ["ok", "ok"]


def _followers() -> list[dict]:
    named = ray.util.list_named_actors(all_namespaces=True)
    return [a for a in named if a["name"].startswith(FOLLOWER_NAME_PREFIX)]


def test_a_lost_tensor_parallel_follower_gets_its_replica_replaced(app, tiny_path):
    """A `--tp-size 2` Generator replica loses its follower rank. Its engine can no longer step,
    so its health check fails and Serve replaces the replica (a new group, a new follower);
    requests succeed again. Without the check the replica stayed, answering 503 for good."""
    config = ServeConfig(
        model_path=str(tiny_path("qwen3_5")),
        served_model_name=MODEL,
        engine=EngineConfig(
            tp_size=2, max_running_prompts=2, max_context_len=1024, num_cpus_per_rank=0.25
        ),
        world_size=2,
        num_cpus_per_deployment=0.1,  # beside the module's app, in its 4 CPUs
    )
    serve.run(build_app(config), name=TP_APP, route_prefix="/tp")

    killed: list[str] = []

    async def scenario() -> Recovery:
        client = openai.AsyncOpenAI(
            base_url=app.base_url.removesuffix("/v1") + "/tp/v1",
            api_key="unused",
            max_retries=0,
            timeout=RECOVERY_LIMIT_S,
        )
        assert (await _ask(client, "Hello?", max_tokens=4)).kind == "ok"
        (follower,) = _followers()
        killed.append(follower["name"])
        (old,) = _replica_names("GeneratorServer", TP_APP)
        ray.kill(ray.get_actor(follower["name"], namespace=follower["namespace"]), no_restart=True)
        killed_at = time.monotonic()
        recovery = await _recover(
            lambda: _ask(client, "Are you back?", max_tokens=4),
            "GeneratorServer",
            old,
            killed_at,
            app=TP_APP,
        )
        await client.close()
        return recovery

    try:
        recovery = asyncio.run(scenario())
        (new_follower,) = _followers()
    finally:
        serve.delete(TP_APP)
    _report("TP follower killed", [], recovery)
    assert new_follower["name"] != killed[0]  # the replacement made a group of its own
