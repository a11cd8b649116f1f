"""What a client is told when serving fails: the serving layer's own errors, `aborted_error`
(a request the engine cut off), `Refused` (a refusal a replica answers with), and `user_error`,
which turns any exception (a replica's ArenoError wrapped by Ray, a dead engine, Serve's
backpressure, a lost replica, a bug) into the typed ArenoError the OpenAI error body is made
of."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TypeVar

from ray.exceptions import ObjectLostError, RayActorError
from ray.serve.exceptions import BackPressureError

from areno.engine.outputs import AbortCause, EngineDeadError, RequestOutput
from areno.errors import ArenoError
from areno.serve.admission import RETRY_AFTER_S, EngineUnavailableError

# A child of "ray.serve": Serve routes it to the replica's log file and the driver's console.
logger = logging.getLogger("ray.serve.areno")

T = TypeVar("T")


@dataclass(frozen=True)
class Refused:
    """A user-facing error a worker replica (Generator, MediaDecoder, Processor) answers with
    (returned, or yielded as a stream's last item) instead of raising it. Serve logs every exception a replica method
    raises, with its traceback, as a failed request: under load each 429 (a full queue) cost
    the busy replica a traceback in its log. A refusal is an answer; `unwrap` raises it again
    in the Ingress."""

    error: ArenoError


def unwrap(value: T | Refused) -> T:
    """`value`, or the error of a Refused raised."""
    if isinstance(value, Refused):
        raise value.error
    return value


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


class RequestAbortedError(ArenoError):
    """The engine cut the request off before it finished (paused for a weight update, shutting
    down): 503 with Retry-After, never a reply that looks complete. A stream already started
    ends with this as its error event."""

    status_code = 503
    error_type = "server_error"
    code = "request_aborted"
    retry_after_s = RETRY_AFTER_S


# Why, as the client reads it, by the engine's abort cause.
_ABORT_REASONS = {
    AbortCause.PAUSE: "the server paused generation (for a weight update or maintenance)",
    AbortCause.SHUTDOWN: "the generation engine is shutting down",
    AbortCause.ENGINE_ERROR: "the generation engine failed a step",
    AbortCause.CALLER: "the server aborted it",
}


def aborted_error(output: RequestOutput) -> RequestAbortedError | None:
    """The error to answer for an engine output in which a sample was aborted, or None."""
    for delta in output.samples:
        if delta.finish_reason == "abort":
            reason = _ABORT_REASONS.get(delta.abort_cause, _ABORT_REASONS[AbortCause.CALLER])
            return RequestAbortedError(
                f"the request was cut off before it finished: {reason}; retry shortly"
            )
    return None


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
    # A replica died: the one serving the request, one before it in a chain (Serve raises that
    # death as the cause of a RayServeException), or the one that held an object the request
    # needs (the Processor holds a StoredPrompt's media tensors until the Generator reads them).
    lost = (RayActorError, ObjectLostError)
    if any(isinstance(e, lost) for e in (error, cause, error.__cause__)):
        logger.warning("a replica died while serving a request: %s", error)
        return ReplicaLostError(
            "the request was cut off: the server replica handling it stopped; its "
            "replacement is starting, retry shortly"
        )
    logger.exception("internal error", exc_info=error)
    internal = ArenoError("internal server error; see the server log")
    internal.status_code, internal.error_type, internal.code = 500, "server_error", "internal"
    return internal
