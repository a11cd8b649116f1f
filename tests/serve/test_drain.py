"""`areno serve` drains when it is told to stop (areno/serve/drain.py).

The live tests run `areno serve` as a user does, as a process of its own on a tiny checkpoint and
a free port, stream replies through the `openai` client, signal the process (SIGTERM as a
supervisor sends it, SIGINT to the process alone, SIGINT to its group as a terminal's Ctrl-C
does), and check what a client and a load balancer see: the streams end with their
finish_reason and `[DONE]` (or, past the grace period, with an error event), a request sent
during the drain and `/health` get 503 with Retry-After, and the process exits 0 within the grace
period plus 10 s, without a traceback. The first tests take the drain apart without Ray."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import openai
import pytest
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from areno.errors import ConfigError
from areno.serve.config import ServeConfig
from areno.serve.drain import Drain, DrainGate, DrainReport, StopSignals, stopped_line
from tests.ray_head import VENV_BIN, free_port, ray_env

# --- the drain without Ray -------------------------------------------------------------------


class FakeCall:
    """A Generator call the drain can cancel (what `Drain.hold` takes)."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    def cancel(self) -> None:
        self.cancelled.set()


def _gated_app(drain: Drain, call: FakeCall) -> Starlette:
    async def stream(request):
        async def lines():
            yield "data: 1\n\n"
            await drain.hold(call).cancelled.wait()  # runs until the drain cuts it off
            yield f"data: {drain.cut_off_error().code}\n\n"

        return StreamingResponse(lines(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/stream", stream), Route("/health", stream)])
    app.add_middleware(DrainGate)
    app.state.drain = drain
    return app


def test_a_drain_refuses_new_requests_and_health_with_503_and_retry_after() -> None:
    drain = Drain()
    drain.draining = True
    client = TestClient(_gated_app(drain, FakeCall()))
    for path, words in (("/health", "draining"), ("/v1/stream", "server_shutting_down")):
        reply = client.get(path)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1", path
        assert words in reply.text, reply.text


def test_a_drain_waits_for_requests_in_flight_then_cuts_off_the_rest() -> None:
    async def scenario() -> tuple[DrainReport, DrainReport]:
        idle = Drain()
        assert await idle.run(grace_s=5.0) == DrainReport(0, 0, pytest.approx(0, abs=0.5))
        drain, call = Drain(), FakeCall()
        drain.hold(call)
        drain.num_in_flight = 1  # what DrainGate counts

        async def request_ends_when_cut_off() -> None:
            await call.cancelled.wait()
            assert drain.cut_off_error().status_code == 503
            drain.num_in_flight -= 1

        ending = asyncio.create_task(request_ends_when_cut_off())
        report = await drain.run(grace_s=0.3)
        await ending
        return report

    report = asyncio.run(scenario())
    assert (report.num_in_flight, report.num_cut_off) == (1, 1)
    assert report.seconds >= 0.3
    assert "1 cut off when the 0.3 s grace period ran out" in stopped_line("SIGTERM", 0.3, report)


def test_signals_while_starting_are_kept_and_a_second_one_interrupts() -> None:
    said: list[str] = []
    signals = StopSignals(said.append)
    before = signal.getsignal(signal.SIGTERM)
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # while starting: kept for when the app is up
        assert said == ["SIGTERM: stopping once the app is up (signal again to stop now)"]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        signals.started()
        os.kill(os.getpid(), signal.SIGINT)  # now only recorded: it cuts a drain short
        assert signals.wait() == "SIGTERM" and signals.received[1:] == ["SIGINT", "SIGINT"]
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_grace_period_is_a_flag_and_a_config_field_checked_once() -> None:
    from areno.cli import build_parser

    args = build_parser().parse_args(["serve", "--shutdown-grace-s", "5"])
    assert args.shutdown_grace_s == 5.0
    assert ServeConfig(model_path="m").shutdown_grace_s == 30.0
    with pytest.raises(ConfigError, match="--shutdown-grace-s"):
        ServeConfig(model_path="m", shutdown_grace_s=-1)


def test_every_deployment_shuts_down_gracefully_for_the_grace_period(tiny_path) -> None:
    """Where Serve stops the replicas itself (an update, a deleted app, a RayService upgrade)
    each one lets its requests finish for the same grace period."""
    from areno.serve.app import SHUTDOWN_WAIT_LOOP_S, build_app

    config = ServeConfig(model_path=str(tiny_path("qwen3_5")), shutdown_grace_s=12.0)
    app = build_app(config)
    ingress = app._bound_deployment
    workers = [bound._bound_deployment for bound in ingress.init_args[:3]]
    for deployment in [ingress, *workers]:
        options = deployment._deployment_config
        assert options.graceful_shutdown_timeout_s == 12.0, deployment.name
        assert options.graceful_shutdown_wait_loop_s == SHUTDOWN_WAIT_LOOP_S


# --- `areno serve` as a process ---------------------------------------------------------------

# Streams that outlast the checks made during the drain (~12 s each, four at once on 2 CPU
# cores) and end well inside the grace period the finishing tests give (twice the default, so
# that a slow machine does not cut them off).
LONG_TOKENS = 2000
GRACE_S = 60
NUM_STREAMS = 4
MODEL = "qwen3_5"  # the tiny checkpoint's directory name


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    lines: list[str] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0
        )

    def health(self) -> tuple[int, dict]:
        """/health's status and headers (their names in lower case)."""
        url = f"http://127.0.0.1:{self.port}/health"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return reply.status, {k.lower(): v for k, v in reply.headers.items()}
        except urllib.error.HTTPError as error:
            return error.code, {k.lower(): v for k, v in error.headers.items()}


@contextlib.contextmanager
def areno_serve(checkpoint, *flags: str):
    """`areno serve` on a free port, in a session of its own, until the block ends (then
    killed with its group if it is still up)."""
    port = free_port()
    env = ray_env()
    env.pop("RAY_ADDRESS", None)  # a Ray of its own, started and stopped by the server
    process = subprocess.Popen(
        [str(VENV_BIN / "areno"), "serve", "--model-path", str(checkpoint), "--port", str(port),
         "--device", "cpu", "--max-running-prompts", str(NUM_STREAMS), *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    server = Server(process, port)
    reader = threading.Thread(target=lambda: server.lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        _wait_healthy(server)
        yield server
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        reader.join(timeout=10)


def _wait_healthy(server: Server, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.process.poll() is None, server.output[-4000:]
        with contextlib.suppress(OSError):
            if server.health()[0] == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"areno serve was not healthy within {timeout} s")


@dataclass
class StreamResult:
    num_chunks: int = 0
    finish_reason: str | None = None
    done: bool = False  # the stream ended cleanly (the client read `[DONE]`)
    error: Exception | None = None


def _stream(client: openai.OpenAI, max_tokens: int, result: StreamResult) -> None:
    try:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count to a thousand."}],
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            result.num_chunks += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                result.finish_reason = chunk.choices[0].finish_reason
        result.done = True
    except Exception as error:  # noqa: BLE001 - the test reads it
        result.error = error


def _start_streams(server: Server, max_tokens: int) -> tuple[list[StreamResult], list]:
    """NUM_STREAMS streams, returned once each has sent a few chunks (all are running)."""
    client = server.client()
    results = [StreamResult() for _ in range(NUM_STREAMS)]
    threads = [
        threading.Thread(target=_stream, args=(client, max_tokens, r), daemon=True) for r in results
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while not all(r.num_chunks >= 5 for r in results):
        assert time.monotonic() < deadline, [r.error for r in results]
        assert not any(r.error for r in results), [r.error for r in results]
        time.sleep(0.05)
    return results, threads


def _send(server: Server, how: str) -> None:
    if how == "SIGTERM":
        os.kill(server.process.pid, signal.SIGTERM)
    elif how == "SIGINT to the process":
        os.kill(server.process.pid, signal.SIGINT)
    else:  # a terminal's Ctrl-C: the whole foreground group, Ray's processes included
        os.killpg(server.process.pid, signal.SIGINT)


def _refused_while_draining(server: Server) -> None:
    """What a client and a load balancer see during the drain: 503 with Retry-After (from the
    moment the server has told its Ingress, a moment after the signal)."""
    deadline = time.monotonic() + 20
    while (status_headers := server.health())[0] == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    status, headers = status_headers
    assert status == 503 and headers.get("retry-after") == "1", (status, headers)
    with pytest.raises(openai.InternalServerError) as refused:
        server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.code == "server_shutting_down"


def _exits_cleanly(server: Server, signalled_at: float, grace_s: float) -> None:
    server.process.wait(timeout=grace_s + 10 - (time.monotonic() - signalled_at))
    time.sleep(0.5)  # the reader thread takes the last lines
    assert server.process.returncode == 0, server.output[-4000:]
    assert "Traceback" not in server.output, server.output[-6000:]
    assert "drained in" in server.output and "; stopped" in server.output, server.output[-2000:]


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT to the process", "SIGINT to the group"])
def test_a_stop_signal_lets_streams_finish_and_refuses_new_requests(tiny_path, how) -> None:
    with areno_serve(tiny_path("qwen3_5"), "--shutdown-grace-s", str(GRACE_S)) as server:
        results, threads = _start_streams(server, LONG_TOKENS)
        _send(server, how)
        signalled_at = time.monotonic()
        at_signal = [r.num_chunks for r in results]
        _refused_while_draining(server)
        for thread in threads:
            thread.join(timeout=GRACE_S)
        for result, before in zip(results, at_signal, strict=True):
            assert result.error is None, result.error
            assert result.done and result.finish_reason == "length", result
            assert result.num_chunks > before  # it was running when the signal came
        _exits_cleanly(server, signalled_at, GRACE_S)
        assert f"{NUM_STREAMS} request(s) finished" in server.output


def test_requests_past_the_grace_period_end_with_an_error(tiny_path) -> None:
    """Four streams and one reply not yet sent outlive a 2 s grace period: each stream ends
    with the error event, the other is a 503 error."""
    grace_s = 2.0
    flags = ("--shutdown-grace-s", str(grace_s), "--max-running-prompts", str(NUM_STREAMS + 1))
    with areno_serve(tiny_path("qwen3_5"), *flags) as server:
        unary: list = []

        def whole_reply() -> None:
            try:
                unary.append(
                    server.client().chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hi"}],
                        max_tokens=4000, extra_body={"ignore_eos": True},
                    )
                )  # fmt: skip
            except openai.APIStatusError as error:
                unary.append(error)

        waiting = threading.Thread(target=whole_reply, daemon=True)
        waiting.start()
        results, threads = _start_streams(server, 4000)
        _send(server, "SIGTERM")
        signalled_at = time.monotonic()
        for thread in [*threads, waiting]:
            thread.join(timeout=60)
        for result in results:
            assert isinstance(result.error, openai.APIError), result
            assert result.error.code == "server_shutting_down", result.error
            assert "grace period of 2 s ran out" in result.error.message
            assert result.finish_reason is None and not result.done
        (error,) = unary
        assert isinstance(error, openai.APIStatusError) and error.status_code == 503, error
        assert error.code == "server_shutting_down" and error.response.headers["retry-after"]
        _exits_cleanly(server, signalled_at, grace_s)
        assert f"{NUM_STREAMS + 1} cut off when the 2 s grace period ran out" in server.output
