"""Admission control of a Generator replica without Ray: the bounded waiting queue (429), the
paused engine (503), a request the engine cut off (503), the errors' wire form and the config
that sets the bound."""

from __future__ import annotations

import asyncio

import pytest

from areno.engine.config import EngineConfig
from areno.engine.outputs import AbortCause, EngineDeadError, RequestOutput, SampleDelta
from areno.engine.sampling import SamplingParams
from areno.errors import ConfigError
from areno.serve.admission import Admission, EngineUnavailableError, QueueFullError
from areno.serve.config import QUEUE_FACTOR, ServeConfig


def test_a_burst_fills_the_slots_then_the_queue_then_is_refused():
    admission = Admission(num_slots=2, max_queued_requests=3)
    for i in range(5):
        admission.admit(f"r{i}", 1)
    assert (admission.num_held, admission.num_queued) == (5, 3)
    with pytest.raises(QueueFullError) as caught:
        admission.admit("r5", 1)
    error = caught.value
    assert (error.status_code, error.code, error.retry_after_s) == (429, "rate_limit_exceeded", 1)
    assert "--max-queued-requests 3" in error.message and "retry" in error.message
    admission.release("r0")  # a running request ends: the oldest waiting one takes its slot
    assert admission.num_queued == 2
    admission.admit("r5", 1)
    assert admission.num_queued == 3


def test_requests_count_their_samples_in_fcfs_order():
    admission = Admission(num_slots=4, max_queued_requests=1)
    admission.admit("a", 3)
    admission.admit("b", 2)  # 3 + 2 > 4: waits, and blocks what comes after it
    assert admission.num_queued == 1
    with pytest.raises(QueueFullError):
        admission.admit("c", 1)  # one slot is free, but strict FCFS puts it behind "b"
    admission.release("a")
    assert admission.num_queued == 0
    admission.admit("c", 1)
    admission.admit("d", 2)  # 2 + 1 + 2 > 4
    assert admission.num_queued == 1


def test_zero_queue_refuses_whatever_cannot_run_at_once():
    admission = Admission(num_slots=1, max_queued_requests=0)
    admission.admit("a", 1)
    with pytest.raises(QueueFullError):
        admission.admit("b", 1)
    admission.release("a")
    admission.release("a")  # releasing twice, or an unknown id, is harmless
    admission.admit("b", 1)


def test_a_request_of_more_samples_than_slots_counts_as_all_of_them():
    admission = Admission(num_slots=2, max_queued_requests=1)
    admission.admit("huge", 8)  # runs as slots allow: it holds both
    admission.admit("next", 1)  # waits
    with pytest.raises(QueueFullError):
        admission.admit("more", 1)
    admission.release("huge")
    assert admission.num_queued == 0


def test_config_bounds_the_queue():
    config = ServeConfig(model_path="m", engine=EngineConfig(max_running_prompts=3))
    assert config.queue_limit == QUEUE_FACTOR * 3
    assert ServeConfig(model_path="m", max_queued_requests=0).queue_limit == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="--max-queued-requests"):
            ServeConfig(model_path="m", max_queued_requests=bad)


DONE = RequestOutput("r", [SampleDelta(0, [7], "x", finish_reason="stop")], finished=True)


class _StubGenerator:
    """What GeneratorServer reads of a Generator, with a scripted pause state and output."""

    def __init__(self, paused: bool, output: RequestOutput = DONE):
        self.is_paused = paused
        self.output = output

    def stats(self) -> dict[str, int]:
        counts = ("num_preemptions", "num_prompt_tokens_admitted", "num_prompt_tokens_cached")
        return {"num_waiting": 0, "num_running": 0, "num_free_blocks": 8} | dict.fromkeys(counts, 0)

    async def generate_all(self, inputs, params, request_id):
        return self.output

    async def generate(self, inputs, params, request_id):
        yield RequestOutput(request_id, [SampleDelta(0, [7], "x")])
        yield self.output

    def shutdown(self) -> None:
        pass


class _Gauge:
    def set(self, value) -> None:
        pass

    def inc(self, value) -> None:
        pass


def _generator_server(paused: bool, max_queued_requests: int = 0, output=DONE):
    from areno.serve.workers import GeneratorServer

    server = GeneratorServer.func_or_class.__new__(GeneratorServer.func_or_class)
    server.generator = _StubGenerator(paused, output)
    server.admission = Admission(1, max_queued_requests)
    server.queue_depth = server.running = server.free_blocks = _Gauge()
    server.counters = dict.fromkeys(server.generator.stats(), _Gauge())
    server._counted = dict.fromkeys(server.counters, 0)
    server._reporter = None
    return server


def test_generator_server_answers_503_while_paused_and_holds_nothing():
    """A refusal is answered as a Refused value (Serve would log a raised one with its
    traceback, as a failed request), unary and streamed; the Ingress raises it (`unwrap`)."""
    from areno.serve.errors import Refused, unwrap

    server = _generator_server(paused=True)
    refused = asyncio.run(server.generate_all(None, SamplingParams(), "r"))
    assert isinstance(refused, Refused)
    with pytest.raises(EngineUnavailableError, match="paused") as caught:
        unwrap(refused)
    assert caught.value.status_code == 503 and caught.value.retry_after_s == 1

    async def stream() -> list:
        return [output async for output in server.generate(None, SamplingParams(), "r2")]

    (only,) = asyncio.run(stream())
    assert isinstance(only.error, EngineUnavailableError)
    assert server.admission.num_held == 0


def test_a_full_queue_is_answered_not_raised():
    from areno.serve.errors import Refused

    server = _generator_server(paused=False, max_queued_requests=0)
    server.admission.admit("held", 1)  # its one slot taken, no queue
    refused = asyncio.run(server.generate_all(None, SamplingParams(), "r"))
    assert isinstance(refused, Refused) and isinstance(refused.error, QueueFullError)
    assert refused.error.status_code == 429
    assert server.admission.num_held == 1  # only the request that holds the slot


def test_generator_server_releases_finished_requests():
    server = _generator_server(paused=False)
    assert asyncio.run(server.generate_all(None, SamplingParams(), "r")) is DONE
    assert asyncio.run(server.generate_all(None, SamplingParams(), "r2")) is DONE
    assert server.admission.num_held == 0


@pytest.mark.parametrize(
    ("cause", "why"),
    [(AbortCause.PAUSE, "paused"), (AbortCause.SHUTDOWN, "shutting down")],
)
def test_a_request_the_engine_cut_off_is_503_never_a_finished_reply(cause, why):
    """An engine output whose sample ended "abort" (one sample finished, one cut off) is
    RequestAbortedError, unary or streamed (after the deltas before it), and is released."""
    from areno.serve.errors import RequestAbortedError, unwrap, user_error

    aborted = RequestOutput(
        "r",
        [
            SampleDelta(0, [], finish_reason="stop"),
            SampleDelta(1, [], finish_reason="abort", abort_cause=cause),
        ],
        finished=True,
    )
    server = _generator_server(paused=False, output=aborted)
    with pytest.raises(RequestAbortedError) as caught:
        unwrap(asyncio.run(server.generate_all(None, SamplingParams(), "r")))
    error = caught.value
    assert user_error(error) is error
    assert (error.status_code, error.code, error.retry_after_s) == (503, "request_aborted", 1)
    assert "cut off" in error.message and why in error.message

    async def stream() -> list:
        outputs = []
        with pytest.raises(RequestAbortedError, match=why):
            async for output in server.generate(None, SamplingParams(), "r2"):
                outputs.append(unwrap(output))
        return outputs

    assert len(asyncio.run(stream())) == 1  # the delta before the abort reached the client
    assert server.admission.num_held == 0


def test_engine_and_serve_overload_errors_map_to_503():
    from ray.serve.exceptions import BackPressureError

    from areno.serve.errors import user_error

    dead = user_error(EngineDeadError("boom"))
    assert (dead.status_code, dead.retry_after_s) == (503, 1)
    backpressure = user_error(BackPressureError(num_queued_requests=3, max_queued_requests=2))
    assert backpressure.status_code == 503 and "overloaded" in backpressure.message
    full = QueueFullError("full")
    assert user_error(full) is full
    assert full.to_dict() == {
        "message": "full",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }


def test_a_replica_lost_before_or_under_the_request_is_503_replica_unavailable():
    """A chain's earlier replica dying (Serve raises a RayServeException caused by its death)
    and the owner of an object the request needs dying both end as the retryable 503."""
    from ray.exceptions import ActorDiedError, OwnerDiedError
    from ray.serve.exceptions import RayServeException

    from areno.serve.errors import user_error

    upstream = RayServeException("an upstream actor died before finishing a dependent task")
    upstream.__cause__ = ActorDiedError()
    owner_gone = OwnerDiedError("a" * 56, "", "")
    for error in (upstream, owner_gone):
        lost = user_error(error)
        assert (lost.status_code, lost.code, lost.retry_after_s) == (503, "replica_unavailable", 1)
