"""Admission control of one Generator replica: a bounded waiting queue instead of an unbounded one.

A request the replica cannot run at once waits for cache slots; at most `max_queued_requests`
wait, and one more is refused at once with 429 (`QueueFullError`), so an overloaded server
answers instead of hanging. An engine that cannot take work (paused, shut down, restarting)
answers 503 (`EngineUnavailableError`). Both carry `retry_after_s` for the `Retry-After` header.
The engine stays unaware of HTTP: this sits in the serve layer, in front of `Generator.generate`.
"""

from __future__ import annotations

from areno.errors import ArenoError

RETRY_AFTER_S = 1


class QueueFullError(ArenoError):
    """The replica's waiting queue is full (HTTP 429; type and code as OpenAI's rate limits)."""

    status_code = 429
    error_type = "requests"
    code = "rate_limit_exceeded"
    retry_after_s = RETRY_AFTER_S


class EngineUnavailableError(ArenoError):
    """The engine cannot take requests now: paused, shutting down or restarting (HTTP 503)."""

    status_code = 503
    error_type = "server_error"
    code = "engine_unavailable"
    retry_after_s = RETRY_AFTER_S


class Admission:
    """The requests one replica holds, in arrival order, and whether one more may wait.

    The scheduler admits strictly first-come first-served into `num_slots` cache slots (a
    request of n samples takes up to n; more samples than slots run as slots free up), so the
    held requests run in arrival order: counting from the oldest, those whose slots fit are
    running, and the rest, from the first that does not fit, are waiting. Counting here rather than from `Generator.stats()` keeps the limit
    exact under a burst: a request counts the moment it is admitted, before the engine thread
    has seen it. (A request is released when its stream ends, a moment after its slots free,
    so the count errs toward refusing.)
    """

    def __init__(self, num_slots: int, max_queued_requests: int) -> None:
        self.num_slots = num_slots
        self.max_queued_requests = max_queued_requests
        self._held: dict[str, int] = {}  # request id -> slots it needs; dicts keep arrival order

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_queued(self) -> int:
        """Held requests waiting for slots."""
        return len(self._held) - self._fit()[0]

    def admit(self, request_id: str, num_seqs: int) -> None:
        """Hold a request, or raise QueueFullError when it would wait and the queue is full.
        A request of more samples than slots counts as all the slots."""
        num_seqs = min(num_seqs, self.num_slots)
        num_running, num_used = self._fit()
        num_queued = len(self._held) - num_running
        would_wait = num_queued > 0 or num_used + num_seqs > self.num_slots
        if would_wait and num_queued >= self.max_queued_requests:
            raise QueueFullError(
                f"the server is at capacity: its {self.num_slots} cache slots are busy and "
                f"{num_queued} requests are already waiting (--max-queued-requests "
                f"{self.max_queued_requests}); retry shortly"
            )
        self._held[request_id] = num_seqs

    def release(self, request_id: str) -> None:
        """Forget a request that finished, failed or was abandoned (unknown ids are ignored)."""
        self._held.pop(request_id, None)

    def _fit(self) -> tuple[int, int]:
        """How many of the oldest held requests fit in the slots together (these run), and the
        slots they take."""
        num_used = 0
        for i, num_seqs in enumerate(self._held.values()):
            if num_used + num_seqs > self.num_slots:
                return i, num_used
            num_used += num_seqs
        return len(self._held), num_used
