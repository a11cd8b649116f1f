"""Trainer -> generator weight sync through the Ray object store.

After each optimizer step the trainable parameters (the frozen towers never change, so they are
not sent) go to every rollout worker, which loads them in place between two engine steps and
takes the new policy version. `WeightSync` also brings a restarted rollout worker (which comes
back with the checkpoint it was built from) to the current policy.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from areno.train.rollouts import RolloutWorkerLostError, wait_all, wait_for_workers

logger = logging.getLogger("areno.train")


def gathered(params: list[torch.nn.Parameter], zero_stage: int):
    """A context in which ZeRO-3 partitioned parameters are whole on every rank."""
    if zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def trainable_state(
    module: torch.nn.Module, zero_stage: int, *, rank: int, names: Sequence[str] | None = None
) -> dict[str, torch.Tensor] | None:
    """Full CPU copies of the trainable parameters on rank 0 (None elsewhere). Every rank must
    call it: under ZeRO-3 gathering is a collective."""
    named = [
        (n, p) for n, p in module.named_parameters() if p.requires_grad or (names and n in names)
    ]
    with gathered([p for _, p in named], zero_stage):
        if rank != 0:
            return None
        return {n: p.detach().to("cpu", copy=True) for n, p in named}


class WeightSync:
    """Rank 0's sender of the trainable weights to the rollout workers.

    It knows the policy version it last sent, so `restore()` can bring a restarted worker back
    to it mid-step. Under ZeRO-2 and below rank 0 holds whole parameters and re-reads them from
    `module`; under ZeRO-3 only a collective of every rank could gather them again, so the
    object-store copy of the last push is kept until the next one (one copy of the trainable
    weights).
    """

    def __init__(
        self, workers: Sequence[Any], module: torch.nn.Module, zero_stage: int, max_retries: int
    ) -> None:
        self.workers = list(workers)
        self.module, self.zero_stage, self.max_retries = module, zero_stage, max_retries
        self.version: int | None = None
        self._kept: Any = None  # ObjectRef of the last push (ZeRO-3 only)

    def push(self, state: dict[str, torch.Tensor], version: int) -> float:
        """Send `state` as policy `version` to every worker; returns seconds taken."""
        import ray

        start = time.perf_counter()
        ref = ray.put(state)
        self.version = version
        self._kept = ref if self.zero_stage == 3 else None
        self._send(list(range(len(self.workers))), ref)
        return time.perf_counter() - start

    def restore(self) -> list[int]:
        """Wait for every worker to answer (a restarting one is asked again until it is back),
        then send the current weights to those behind the current version (a restarted worker
        holds the initial weights). Returns their indices."""
        versions = wait_for_workers(self.workers, range(len(self.workers)))
        behind = [i for i, v in sorted(versions.items()) if v != self.version]
        if behind and self.version is not None:
            self._send(behind, self._current())
        return behind

    def _current(self) -> Any:
        import ray

        if self._kept is not None:
            return self._kept
        return ray.put(trainable_state(self.module, self.zero_stage, rank=0))

    def _send(self, indices: list[int], ref: Any) -> None:
        """update_weights on the workers `indices`; those lost during the call are waited for
        (Ray restarts them) and sent the weights again."""
        for attempt in range(self.max_retries + 1):
            calls = [self.workers[i].update_weights.remote(ref, self.version) for i in indices]
            try:
                wait_all(calls, indices)
                return
            except RolloutWorkerLostError as error:
                if attempt == self.max_retries:
                    raise
                logger.warning(
                    "areno train: weight sync of policy version %s is sent again because %s",
                    self.version,
                    error,
                )
                indices = error.indices
                wait_for_workers(self.workers, indices)
