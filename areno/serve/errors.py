"""What a client is told when serving fails: the serving layer's own errors, and `user_error`,
which turns any exception (a replica's ArenoError wrapped by Ray, a dead engine, Serve's
backpressure, a lost replica, a bug) into the typed ArenoError the OpenAI error body is made of."""

from __future__ import annotations

import logging

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from areno.engine.generator import EngineDeadError
from areno.errors import ArenoError
from areno.serve.admission import RETRY_AFTER_S, EngineUnavailableError

# A child of "ray.serve": Serve routes it to the replica's log file and the driver's console.
logger = logging.getLogger("ray.serve.areno")


class ModelNotFoundError(ArenoError):
    status_code = 404
    code = "model_not_found"


class AuthenticationError(ArenoError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class ReplicaLostError(ArenoError):
    """A replica died while it held the request (a crash, a kill, a lost node). Serve starts a
    replacement, so this is 503 with Retry-After, not an internal error: retrying succeeds."""

    status_code = 503
    error_type = "server_error"
    code = "replica_unavailable"
    retry_after_s = RETRY_AFTER_S


def user_error(error: Exception) -> ArenoError:
    """The ArenoError behind `error` (Ray wraps a replica's exception in RayTaskError), or a
    generic server error for anything else (logged, never shown to the client)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, ArenoError):
        return cause
    if isinstance(error, ArenoError) and hasattr(error, "message"):
        return error
    if isinstance(cause, EngineDeadError) or isinstance(error, EngineDeadError):
        return EngineUnavailableError("the generation engine is restarting; retry shortly")
    if isinstance(cause, BackPressureError) or isinstance(error, BackPressureError):
        return EngineUnavailableError("the server is overloaded; retry shortly")
    if isinstance(cause, RayActorError) or isinstance(error, RayActorError):
        logger.warning("a replica died while serving a request: %s", error)
        return ReplicaLostError(
            "a server replica stopped while handling this request; its replacement is "
            "starting, retry shortly"
        )
    logger.exception("internal error", exc_info=error)
    internal = ArenoError("internal server error; see the server log")
    internal.status_code, internal.error_type, internal.code = 500, "server_error", "internal"
    return internal
