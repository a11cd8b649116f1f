"""The trainer's Ray calls to the rollout workers: dispatch a batch of groups, gather it.

Workers get `Sample.public()`: private metadata never leaves rank 0, where the reward reads it
(`areno.train.controller`). A worker that dies mid-call surfaces as `RolloutWorkerLostError` once
every other call of the batch has finished, so the caller can retry the batch on a clean slate.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from areno.data import Sample
from areno.engine.sampling import SamplingParams
from areno.errors import ArenoError
from areno.rollout.trajectory import Trajectory

# How long a restarting rollout worker may take to come back (it loads its model again).
RESTART_TIMEOUT_S = 900.0


class RolloutWorkerLostError(RuntimeError):
    """Rollout worker actors died during a batch of calls (a crashed process, a lost node).
    `indices` are their positions in the worker list; Ray restarts them (rollout.max_restarts)
    with the checkpoint they were built from, so they need the current weights again."""

    def __init__(self, message: str, indices: Sequence[int]) -> None:
        super().__init__(message)
        self.indices = list(indices)

    def __reduce__(self) -> tuple:
        # Raised in a Ray Train worker and re-raised in the driver: pickled with both fields.
        return (type(self), (str(self), self.indices))

    @classmethod
    def from_errors(cls, lost: dict[int, Exception]) -> RolloutWorkerLostError:
        indices = sorted(lost)
        first = str(lost[indices[0]]).strip().splitlines()[0]
        return cls(f"rollout worker(s) {indices} died during the call ({first})", indices)


def wait_all(refs: Sequence[Any], worker_indices: Sequence[int]) -> list[Any]:
    """The results of calls `refs` (`worker_indices[i]`: the worker of call i), once ALL have
    finished, so that a retry never overlaps the calls still running on healthy workers.
    Raises RolloutWorkerLostError naming the workers whose calls died with them."""
    import ray
    from ray.exceptions import RayActorError

    if refs:
        ray.wait(list(refs), num_returns=len(refs))
    results, lost = [], {}
    for ref, index in zip(refs, worker_indices, strict=True):
        try:
            results.append(ray.get(ref))
        except RayActorError as error:
            lost.setdefault(index, error)
            results.append(None)
    if lost:
        raise RolloutWorkerLostError.from_errors(lost)
    return results


def wait_for_workers(
    workers: Sequence[Any], indices: Sequence[int], timeout_s: float = RESTART_TIMEOUT_S
) -> dict[int, int]:
    """The policy version of each worker `indices`, once it answers. Ray refuses calls to a
    worker while it restarts (ActorUnavailableError), so it is asked again until it is back.
    Raises RolloutWorkerLostError for a worker dead for good (out of restarts) or not back
    within `timeout_s`."""
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    deadline = time.monotonic() + timeout_s
    versions: dict[int, int] = {}
    pending = list(indices)
    while pending:
        refs = [workers[i].policy_version.remote() for i in pending]
        restarting = []
        for index, ref in zip(pending, refs, strict=True):
            try:
                versions[index] = ray.get(ref)
            except ActorUnavailableError:
                restarting.append(index)
            except ActorDiedError as error:
                raise RolloutWorkerLostError.from_errors({index: error}) from error
        if restarting and time.monotonic() > deadline:
            raise RolloutWorkerLostError(
                f"rollout worker(s) {restarting} not back within {timeout_s:.0f} s", restarting
            )
        if restarting:
            time.sleep(0.2)
        pending = restarting
    return versions


@dataclass
class Dispatched:
    """A batch of groups sent to the workers, not yet gathered (`dispatch`, `gather`)."""

    refs: list[Any]
    indices: list[int]  # the worker of each call


def dispatch(
    workers: Sequence[Any],
    samples: Sequence[Sample],
    group_size: int,
    sampling: SamplingParams,
    *,
    seed: int | None = None,
) -> Dispatched:
    """Start one group per sample, spread round-robin over the workers. The seeds depend only
    on `seed` and the sample's index, so a retried batch samples again exactly what the lost
    one would have."""
    refs, indices = [], []
    for index, sample in enumerate(samples):
        public = sample.public()
        params = sampling
        if seed is not None:
            params = dataclasses.replace(sampling, seed=seed + 100_003 * index)
        worker = workers[index % len(workers)]
        refs.append(
            worker.run_group.remote(public.id, public.messages, group_size, params, public.tools)
        )
        indices.append(index % len(workers))
    return Dispatched(refs, indices)


@dataclass
class Gathered:
    """A batch's groups in sample order (a skipped sample's is empty), the seconds its slowest
    group took on its worker, and why each skipped sample was skipped (by its index).
    `phases`: the seconds of work per phase on the workers, summed over the groups
    (`GroupResult.phases`); `engine`: each worker's engine seconds so far when its last
    group of the batch ended (by the worker's index)."""

    groups: list[list[Trajectory]]
    seconds: float
    skipped: dict[int, str]
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    engine: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)


def gather(dispatched: Dispatched) -> Gathered:
    """The groups of a dispatched batch; `seconds` from each group's start on its worker,
    however long after that it is gathered."""
    results = wait_all(dispatched.refs, dispatched.indices)
    seconds = max((sum(r.timings.values()) for r in results), default=0.0)
    skipped = {i: r.skipped for i, r in enumerate(results) if r.skipped is not None}
    phases: dict[str, float] = {}
    engine: dict[int, dict[str, float]] = {}
    for result, worker in zip(results, dispatched.indices, strict=True):
        for key, value in result.phases.items():
            phases[key] = phases.get(key, 0.0) + value
        latest = engine.setdefault(worker, dict(result.engine))
        for key, value in result.engine.items():
            latest[key] = max(latest.get(key, 0.0), value)
    return Gathered([r.trajectories for r in results], seconds, skipped, phases, engine)


class RolloutStartError(ArenoError):
    """A rollout worker could not start (its engine, decoder, processor or agent raised while
    it was built). The message ends with the worker's own error; its traceback is in the log."""

    status_code = 500
    error_type = "server_error"
    code = "rollout_worker_failed"


def rollout_start_error(ready: list) -> RolloutStartError | None:
    """Waits for `ready` (each rollout worker's first call): None once every worker started,
    else the first one's construction error as a RolloutStartError. Any other failure raises."""
    import ray

    try:
        ray.get(ready)
    except ray.exceptions.RayActorError as error:
        if not error.actor_init_failed:
            raise
        # Ray's message: the creation task's traceback, the worker's own error last
        cause = [line for line in str(error).splitlines() if line.strip()][-1]
        return RolloutStartError(
            f"a rollout worker could not start: {cause.strip()} (its traceback is in the "
            "rollout worker's log above)"
        )
    return None
