"""Trainer rank 0's side of a step: dispatch groups to the rollout workers, score them.

Private metadata never leaves this process: workers get `Sample.public()`, the reward reads the
private part here. A worker that dies mid-call surfaces as `RolloutWorkerLostError` once every
other call of the batch has finished, so the caller can retry the batch on a clean slate.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from areno.data import Sample
from areno.engine.sampling import SamplingParams
from areno.rewards import combine
from areno.rollout.trajectory import Trajectory
from areno.train.grpo import group_advantages

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
    group took on its worker, and why each skipped sample was skipped (by its index)."""

    groups: list[list[Trajectory]]
    seconds: float
    skipped: dict[int, str]


def gather(dispatched: Dispatched) -> Gathered:
    """The groups of a dispatched batch; `seconds` from each group's start on its worker,
    however long after that it is gathered."""
    results = wait_all(dispatched.refs, dispatched.indices)
    seconds = max((sum(r.timings.values()) for r in results), default=0.0)
    skipped = {i: r.skipped for i, r in enumerate(results) if r.skipped is not None}
    return Gathered([r.trajectories for r in results], seconds, skipped)


def collect(
    workers: Sequence[Any],
    samples: Sequence[Sample],
    group_size: int,
    sampling: SamplingParams,
    *,
    seed: int | None = None,
) -> Gathered:
    """`dispatch`, then `gather`."""
    return gather(dispatch(workers, samples, group_size, sampling, seed=seed))


def prompt_token_counts(workers: Sequence[Any]) -> list[tuple[int, int]]:
    """Each worker's engine counters: prompt tokens admitted, and of them those its prefix cache
    held (read before and after a rollout: `prefill_metrics`)."""
    stats = wait_all([w.stats.remote() for w in workers], list(range(len(workers))))
    return [(s["num_prompt_tokens_admitted"], s["num_prompt_tokens_cached"]) for s in stats]


def prefill_metrics(
    before: Sequence[tuple[int, int]], after: Sequence[tuple[int, int]]
) -> dict[str, float]:
    """Prompt tokens the rollout asked the engines to prefill, those they computed (the rest
    the prefix cache held) and the hit rate; a restarted worker counts from zero."""
    requested = cached = 0
    for (admitted_0, cached_0), (admitted_1, cached_1) in zip(before, after, strict=True):
        restarted = admitted_1 < admitted_0
        requested += admitted_1 - (0 if restarted else admitted_0)
        cached += cached_1 - (0 if restarted else cached_0)
    return {
        "prefill_tokens_requested": float(requested),
        "prefill_tokens_computed": float(requested - cached),
        "prefix_hit_rate": cached / requested if requested else 0.0,
    }


def score(
    reward_fn: Callable[..., Any],
    groups: Sequence[Sequence[Trajectory]],
    samples: Sequence[Sample],
    reward_kwargs: dict | None = None,
) -> float:
    """Set each trajectory's reward (and components) from its sample's private metadata."""
    start = time.perf_counter()
    for group, sample in zip(groups, samples, strict=True):
        for traj in group:
            value = reward_fn(traj, sample.private, **(reward_kwargs or {}))
            if isinstance(value, dict):
                traj.reward_components = {k: float(v) for k, v in value.items()}
                traj.reward = float(combine(traj.reward_components))
            else:
                traj.reward = float(value)
    return time.perf_counter() - start


def advantages(groups: Sequence[Sequence[Trajectory]], normalize_std: bool) -> torch.Tensor:
    rewards = torch.tensor([t.reward for group in groups for t in group], dtype=torch.float32)
    group_ids = [g for g, group in enumerate(groups) for _ in group]
    return group_advantages(rewards, group_ids, normalize_std=normalize_std)


def rollout_metrics(trajectories: Sequence[Trajectory], prefix: str = "") -> dict[str, float]:
    """Reward, accuracy, lengths and tool use over a list of trajectories."""
    n = max(len(trajectories), 1)
    rewards = torch.tensor([t.reward or 0.0 for t in trajectories], dtype=torch.float64)
    metrics = {
        "episodes": float(len(trajectories)),
        "reward_mean": rewards.mean().item() if len(trajectories) else 0.0,
        "reward_std": rewards.std(unbiased=False).item() if len(trajectories) else 0.0,
        "accuracy": sum(_is_correct(t) for t in trajectories) / n,
        "response_len_mean": sum(t.num_generated_tokens for t in trajectories) / n,
        "episode_len_mean": sum(t.num_tokens for t in trajectories) / n,
        "turns_mean": sum(t.num_turns for t in trajectories) / n,
        "tool_calls_per_episode": sum(len(t.tool_calls) for t in trajectories) / n,
        "malformed_tool_calls": float(sum(t.num_malformed_tool_calls for t in trajectories)),
        "aborted_episodes": float(sum(t.finish == "aborted" for t in trajectories)),
    }
    names = sorted({k for t in trajectories for k in t.reward_components})
    for name in names:
        metrics[f"reward/{name}"] = (
            sum(t.reward_components.get(name, 0.0) for t in trajectories) / n
        )
    return {f"{prefix}{k}": v for k, v in metrics.items()}


def _is_correct(traj: Trajectory) -> bool:
    if "accuracy" in traj.reward_components:
        return traj.reward_components["accuracy"] >= 0.5
    return (traj.reward or 0.0) >= 1.0 - 1e-6
