"""Graceful drain of the Ingress: how a stopping server ends the requests it holds.

A server told to stop (`areno serve` on SIGTERM or Ctrl-C, see areno/serve/app.py `run_server`)
first drains its Ingress replica: from then on every new HTTP request, `/health` included, is
answered 503 with `Retry-After` (a load balancer stops routing here, a client retries
elsewhere), while the requests already in flight, streamed ones included, run to their end. When
the grace period (`--shutdown-grace-s`) runs out first, the Generator calls of those still open are
cancelled: a stream ends with an error event (`server_shutting_down`), a reply not yet sent is a
503 error body. Only then are Serve and Ray stopped, with nothing left in flight.

The gate is an ASGI middleware (`DrainGate`), so it counts a streamed reply until its last
byte is sent, whichever route made it. The Ingress hands it the replica's `Drain` through the
app's state, and marks the Generator calls it makes with `Drain.hold`.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.responses import JSONResponse

from areno.errors import ArenoError
from areno.protocol.errors import ErrorResponse
from areno.serve.admission import RETRY_AFTER_S

T = TypeVar("T")

# How often the drain looks at the requests in flight while it waits for them.
POLL_S = 0.05
# After the grace period, how long the cut-off requests get to write their error events.
CUT_OFF_S = 5.0


class ServerShuttingDownError(ArenoError):
    """The server is stopping: a new request is refused, or one in flight outlived the grace
    period (HTTP 503 with Retry-After: another replica, or this one restarted, will answer)."""

    status_code = 503
    error_type = "server_error"
    code = "server_shutting_down"
    retry_after_s = RETRY_AFTER_S


@dataclass(frozen=True)
class DrainReport:
    """What a drain did: requests in flight when it began, and those cut off at the deadline."""

    num_in_flight: int
    num_cut_off: int
    seconds: float


class Drain:
    """One Ingress replica's drain state. NOTE: touched only on the replica's event loop."""

    def __init__(self) -> None:
        self.draining = False
        self.expired = False
        self.num_in_flight = 0
        self.grace_s = 0.0
        self._end_grace = False
        # Generator calls in flight (Serve responses, stream generators, prompt batches): each
        # has cancel(). Weak: a finished call leaves the set when it is dropped.
        self._held: weakref.WeakSet = weakref.WeakSet()

    def hold(self, call: T) -> T:
        """`call` (anything with cancel()), to be cancelled if it outlives the grace period."""
        self._held.add(call)
        return call

    def cut_off_error(self) -> ArenoError | None:
        """The error of a request that failed once the grace period ran out (its Generator
        call cancelled), or None before."""
        if not self.expired:
            return None
        return ServerShuttingDownError(
            f"the server shut down before this request finished (its grace period of "
            f"{self.grace_s:g} s ran out); retry: another replica, or this server restarted, "
            f"will answer"
        )

    def refusal(self, path: str) -> JSONResponse:
        """The answer to a request that arrives while draining: 503 with Retry-After."""
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        if path == "/health":
            body = {"status": "draining", "detail": "the server is shutting down"}
            return JSONResponse(body, status_code=503, headers=headers)
        error = ServerShuttingDownError(
            "the server is shutting down and takes no new requests; retry shortly "
            "(another replica, or this server restarted, will answer)"
        )
        body = ErrorResponse.from_error(error).model_dump()
        return JSONResponse(body, status_code=503, headers=headers)

    def end_grace(self) -> None:
        """Cut the grace period short (a second signal to the server)."""
        self._end_grace = True

    async def run(self, grace_s: float) -> DrainReport:
        """Refuse new requests, wait up to `grace_s` for those in flight, cancel the rest, and
        wait (briefly) for them to write their errors."""
        start = time.monotonic()
        self.draining, self.grace_s = True, grace_s
        num_in_flight = self.num_in_flight
        deadline = start + grace_s
        while self.num_in_flight and time.monotonic() < deadline and not self._end_grace:
            await asyncio.sleep(POLL_S)
        num_cut_off = self.num_in_flight
        if num_cut_off:
            self.expired = True
            for call in list(self._held):
                call.cancel()
            cut_off_deadline = time.monotonic() + CUT_OFF_S
            while self.num_in_flight and time.monotonic() < cut_off_deadline:
                await asyncio.sleep(POLL_S)
        return DrainReport(num_in_flight, num_cut_off, time.monotonic() - start)


class DrainGate:
    """ASGI middleware of the Ingress: counts the HTTP requests in flight (a streamed one until
    its last byte) and, while its replica drains, answers each new one with 503. It finds the
    replica's Drain in the app's state (`app.state.drain`, set by the Ingress)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        drain: Drain | None = getattr(scope["app"].state, "drain", None)
        if scope["type"] != "http" or drain is None:
            await self.app(scope, receive, send)
            return
        if drain.draining:
            await drain.refusal(scope["path"])(scope, receive, send)
            return
        drain.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            drain.num_in_flight -= 1


class StopSignals:
    """SIGTERM and SIGINT to `areno serve` (one process or its whole group, as a terminal's
    Ctrl-C sends). The first starts the drain, a later one cuts its grace period short. Until
    `started()` (the app is starting), the first is kept for when the app is up (its Ingress
    may already answer requests), and a second one interrupts the start (KeyboardInterrupt)."""

    def __init__(self, announce: Callable[[str], None]) -> None:
        self._starting = True
        self.received: list[str] = []
        self._announce = announce
        self._first = threading.Event()
        self._saved: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._saved[sig] = signal.signal(sig, self._on_signal)

    def started(self) -> None:
        """From now on a signal never interrupts: it starts the drain or cuts it short."""
        self._starting = False

    def restore(self) -> None:
        """The handlers there were before `install`."""
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        self.received.append(name)
        self._first.set()
        if self._starting:
            if len(self.received) > 1:
                raise KeyboardInterrupt
            self._announce(f"{name}: stopping once the app is up (signal again to stop now)")

    def wait(self) -> str:
        """Block until a signal comes; its name."""
        while not self._first.wait(timeout=1.0):  # a timeout keeps the handlers running
            pass
        return self.received[0]


def drain_app(app_name: str, grace_s: float, signals: StopSignals) -> DrainReport | None:
    """Drain the app's Ingress (`Ingress.drain_requests`) and wait for it: a second signal
    cuts the grace period short. None when the Ingress could not be asked (already gone)."""
    from ray import serve
    from ray.exceptions import RayError
    from ray.serve.exceptions import RayServeException

    try:
        ingress = serve.get_deployment_handle("Ingress", app_name=app_name)
        response = ingress.drain_requests.remote(grace_s)
        cut_short = False
        deadline = time.monotonic() + grace_s + CUT_OFF_S + 30
        while time.monotonic() < deadline:
            if len(signals.received) > 1 and not cut_short:
                ingress.end_grace.remote()
                cut_short = True
            try:
                return response.result(timeout_s=POLL_S * 10)
            except TimeoutError:
                continue
    except (RayError, RayServeException):
        return None
    return None


def stopped_line(signal_name: str, grace_s: float, report: DrainReport | None) -> str:
    """The one line `areno serve` ends with."""
    if report is None:
        return f"{signal_name}: stopped (the app could not be drained; requests may be lost)"
    done = report.num_in_flight - report.num_cut_off
    line = f"{signal_name}: drained in {report.seconds:.1f} s: {done} request(s) finished"
    if report.num_cut_off:
        line += f", {report.num_cut_off} cut off when the {grace_s:g} s grace period ran out"
    return line + "; stopped"
