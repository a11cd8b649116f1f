"""The guarded Gemma 4 app: the API key on every route but /health, /health saying "starting"
until the engine is up, media outside its allowed root and remote URLs refused, overload refused
with 429 beyond --max-queued-requests, and a batch's other prompts stopped when one is refused or
the client leaves."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import openai
import pytest
from ray import serve

from areno.engine.config import EngineConfig
from areno.media.samples import write_image
from areno.serve.app import APP_NAME, build_app
from areno.serve.config import ServeConfig
from tests.serve.live.openai_server.client import API_KEY, ask, complete, guarded_client


def _routes(routes):
    """The app's routes, through the routers Serve's ingress includes them with."""
    for route in routes:
        if hasattr(route, "original_router"):
            yield from _routes(route.original_router.routes)
        elif hasattr(route, "methods"):
            yield route


def test_api_key_is_required_on_every_route_but_health(server):
    import httpx2

    from areno.serve.ingress import api

    base = str(guarded_client(server).base_url).rstrip("/")
    with pytest.raises(openai.AuthenticationError):
        guarded_client(server, key="wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        ask(guarded_client(server, key="wrong"), "hi")
    # Every route the app defines (so a new one is covered too): no key, a wrong one, the key
    # without "Bearer" or in another scheme.
    app_base = base.removesuffix("/v1")
    routes = [(m, r.path) for r in _routes(api.routes) for m in r.methods if m != "HEAD"]
    expected = {("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions")}
    assert expected | {("POST", "/v1/completions")} <= set(routes)
    for method, path in routes:
        for auth in (None, "Bearer wrong", API_KEY, f"Basic {API_KEY}", f"Bearer {API_KEY}x"):
            headers = {"Authorization": auth} if auth else {}
            response = httpx2.request(method, app_base + path, headers=headers, json={}, timeout=60)
            if path == "/health":
                assert response.status_code == 200
                continue
            assert response.status_code == 401, (method, path, auth)
            assert response.json()["error"]["code"] == "invalid_api_key"
    # FastAPI's schema and docs pages are not served: they would answer without the key.
    for path in ("/openapi.json", "/docs", "/redoc"):
        response = httpx2.get(app_base + path, timeout=60)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert [m.id for m in guarded_client(server).models.list().data] == ["tiny-gemma4"]


def test_health_says_starting_until_the_engine_is_up(server, tiny_path):
    """The Ingress answers HTTP as soon as its replica runs; `/health` must not say "ok" while
    the Generator is still starting. Here it can never start (it needs a resource no node has),
    so its app stays deploying while the Ingress answers."""
    import httpx2

    base = str(server.base_url).rstrip("/").removesuffix("/v1")
    config = ServeConfig(
        model_path=str(tiny_path("gemma4")),
        engine=EngineConfig(max_running_prompts=1, max_context_len=256),
        num_cpus_per_deployment=0.05,  # the test instance's 4 CPUs are mostly taken
        deployment_resources={"generator": {"areno_test_absent": 1}},
    )
    target = serve.RunTarget(build_app(config), name="starting", route_prefix="/starting")
    serve.run_many([target], wait_for_applications_running=False)

    def health():
        """The new app's /health; None while its Ingress replica is still starting (a loaded
        machine can keep the first answer longer than a read timeout)."""
        try:
            return httpx2.get(f"{base}/starting/health", timeout=30)
        except httpx2.TimeoutException:
            return None

    try:
        deadline = time.monotonic() + 240
        response = health()
        while (response is None or response.status_code != 503) and time.monotonic() < deadline:
            time.sleep(0.5)  # 404 from the root app until this app's route exists
            response = health()
        assert response is not None and response.status_code == 503, response
        assert response.json()["status"] == "starting"
        assert "still starting" in response.json()["detail"]
        assert httpx2.get(f"{base}/health", timeout=30).json() == {"status": "ok"}
    finally:
        serve.delete("starting")


def test_guarded_server_refuses_media_outside_its_roots_and_remote_urls(
    server, media, media_root, http_media
):
    client = guarded_client(server)
    inside = write_image(media_root / "ok.png", 32, 32)
    assert ask(client, [{"type": "image_url", "image_url": {"url": str(inside)}}]).choices
    refused = {
        media["image"]: "allowed",
        f"{http_media}/a.png": "remote",
    }
    for url, needle in refused.items():
        with pytest.raises(openai.APIStatusError) as caught:
            ask(client, [{"type": "image_url", "image_url": {"url": url}}])
        assert 400 <= caught.value.status_code < 500
        assert needle in caught.value.message.lower(), caught.value.message


def test_overload_is_refused_with_429_and_the_server_keeps_serving(server):
    """More concurrent requests than the guarded app's 2 slots + 1 waiting place: each is
    answered or refused at once with 429 and Retry-After, never left hanging."""
    client = guarded_client(server)  # max_retries=0: a 429 reaches the test

    def call(i: int):
        try:
            return ask(client, f"Long answer {i}", max_tokens=256, extra_body={"ignore_eos": True})
        except openai.RateLimitError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        results = list(pool.map(call, range(10), timeout=300))
    answered = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert answered and refused
    assert all(r.choices[0].finish_reason == "length" for r in answered)
    for error in refused:
        assert error.status_code == 429
        assert "--max-queued-requests" in error.message
        assert error.code == "rate_limit_exceeded"
        assert int(error.response.headers["retry-after"]) >= 1
    assert ask(client, "Fresh request after the burst.").choices[0].finish_reason
    # A refusal is the replica's answer, not a failed request that Serve logs with its
    # traceback (areno/serve/errors.py, `Refused`): nothing of the 429s in its log.
    logs = _replica_logs("guarded", "GeneratorServer")
    assert logs and "QueueFullError" not in logs and "Request failed" not in logs


def _replica_logs(app: str, deployment: str) -> str:
    """The text of the Serve log files of `app`'s `deployment` replicas in this Ray session."""
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    files = sorted((session / "logs" / "serve").glob(f"replica_{app}_{deployment}_*.log"))
    return "\n".join(path.read_text(errors="replace") for path in files)


def _time_per_100_tokens(client) -> float:
    """Seconds the guarded app takes for 100 tokens of its 2 running rows, overheads included."""

    started = time.monotonic()
    complete(client, ["Two", "rows"], max_tokens=100, extra_body={"ignore_eos": True})
    return time.monotonic() - started


def _wait_until_idle(app: str, timeout_s: float) -> dict:
    """The app's engine stats once nothing runs or waits there, or at the timeout."""

    generator = serve.get_deployment_handle("GeneratorServer", app)
    deadline = time.monotonic() + timeout_s
    while (stats := generator.stats.remote().result())["num_running"] + stats["num_waiting"]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return stats


LONG = {"max_tokens": 1500, "extra_body": {"ignore_eos": True}}


def test_a_refused_prompt_of_a_batch_fails_it_and_stops_the_others(server):
    """The guarded app runs 2 sequences and lets 1 wait: of 5 prompts, the fourth is refused
    (429), and the request's other prompts, each its own engine request, are aborted rather
    than left generating 1500 tokens each (15 times the time allowed here)."""
    client = guarded_client(server)
    time_per_100 = _time_per_100_tokens(client)
    with pytest.raises(openai.RateLimitError) as caught:
        complete(client, ["Long"] * 5, **LONG)
    assert "--max-queued-requests" in caught.value.message
    stats = _wait_until_idle("guarded", 3 * time_per_100)
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert complete(client, ["Fresh", "batch"], max_tokens=3).usage.completion_tokens > 0


def test_a_streamed_batch_stops_when_its_client_leaves(server):
    client = guarded_client(server)
    time_per_100 = _time_per_100_tokens(client)
    stream = complete(client, ["Long", "longer"], stream=True, **LONG)
    assert next(iter(stream)).object == "text_completion"
    stream.close()
    stats = _wait_until_idle("guarded", 3 * time_per_100)
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_clients_that_leave_are_quiet_and_the_server_keeps_serving(server):
    """Streams closed after their first chunk and clients giving up after 0.2 s: their engine
    work stops and no replica logs a traceback for them (asyncio's "Future exception was
    never retrieved" of the cancelled request, one per departed stream before); the next
    request is answered."""
    client = server.with_options(max_retries=0)
    time_per_100 = _time_per_100_tokens(client)
    impatient = client.with_options(timeout=0.2)
    before = _session_log_sizes()

    def leave(i: int) -> None:
        if i % 2:
            stream = complete(client, f"Stream {i}", stream=True, **LONG)
            next(iter(stream))
            stream.close()
            return
        with pytest.raises(openai.APITimeoutError):
            complete(impatient, f"Slow {i}", **LONG)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(leave, range(6)))
    stats = _wait_until_idle(APP_NAME, 6 * time_per_100)
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert ask(client, "Still here?").choices[0].finish_reason
    time.sleep(1)  # what the replicas print of the burst reaches their log files
    logs = _session_logs_since(before)
    assert "never retrieved" not in logs and "TaskCancelledError" not in logs


def _session_log_sizes() -> dict[Path, int]:
    """The size of every log file of this Ray session (replicas' stderr and Serve's logs)."""
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    return {
        path: path.stat().st_size
        for path in (session / "logs").rglob("*")
        if path.is_file() and path.suffix in (".err", ".out", ".log")
    }


def _session_logs_since(sizes: dict[Path, int]) -> str:
    """What this session's log files gained since `sizes` was taken (new files whole)."""
    texts = []
    for path in _session_log_sizes():
        with path.open("rb") as f:
            f.seek(sizes.get(path, 0))
            texts.append(f.read().decode(errors="replace"))
    return "\n".join(texts)
