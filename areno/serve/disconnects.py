"""A client that leaves mid-request is normal, not a failure: counted, logged at debug level, no
traceback.

When a client closes its connection, Serve cancels the request in the Ingress replica, and the
cancellation surfaces inside the app as Ray's `TaskCancelledError` raised from the request's
receive channel (Starlette's streaming response listens on it for the disconnect). Left to
propagate, it reached Serve's request task, whose result nobody reads any more: asyncio printed
"Future exception was never retrieved" with a 40-line traceback per departed streaming client.
The engine work is cancelled either way (the Generator's stream is closed with the response).
"""

from __future__ import annotations

import logging

from ray.exceptions import TaskCancelledError

# A child of "ray.serve": Serve routes it to the replica's log file.
log = logging.getLogger("ray.serve.areno.disconnects")


class QuietDisconnects:
    """ASGI middleware of the Ingress: an HTTP request cancelled because its client left ends
    quietly and is counted (`areno_client_disconnects`)."""

    def __init__(self, app) -> None:
        self.app = app
        self._counter = None

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.app(scope, receive, send)
        except TaskCancelledError:  # Serve's RequestCancelledError is one too
            if scope["type"] != "http":
                raise
            self._count()
            log.debug("client left: %s %s", scope.get("method"), scope.get("path"))

    def _count(self) -> None:
        if self._counter is None:
            from ray.serve import metrics

            self._counter = metrics.Counter(
                "areno_client_disconnects",
                "Requests whose client left before the reply ended (their engine work stopped).",
            )
        self._counter.inc()
