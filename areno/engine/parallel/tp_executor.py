"""The tensor-parallel executor: rank 0 runs in the engine's process, ranks 1.. are Ray actors.

Rank 0 schedules (the engine lives there) and the others follow: every step rank 0 broadcasts
the step's forward inputs over the gloo control group, all ranks run the same forward (the TP
collectives run on the default group, NCCL on GPU), and only rank 0 samples. The followers sit on
the same node as rank 0: in the bundles of the caller's placement group when it has one per rank
(a Serve replica with STRICT_PACK bundles), else pinned to rank 0's node.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import signal
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from areno.engine.config import EngineConfig
from areno.engine.outputs import TokenScores
from areno.engine.parallel import tensor_parallel
from areno.engine.parallel.executor import Executor
from areno.engine.parallel.ipc import visible_gpu_uuids
from areno.engine.parallel.worker import Worker
from areno.engine.step import StepInput, StepOutput
from areno.errors import ConfigError
from areno.models.registry import adapter_for_checkpoint
from areno.processing.types import PromptInputs

LOOPBACK = "127.0.0.1"  # every rank is on one node (see the module docstring)
# Seconds between rank 0's checks that every follower still follows. A follower whose loop ended
# (an error in its forward) leaves rank 0 waiting in the next broadcast, unless rank 0 looks first.
FOLLOWER_CHECK_S = 1.0
FOLLOWER_NAME_PREFIX = "areno-tp-follower-"

log = logging.getLogger(__name__)


class FollowerLostError(RuntimeError):
    """A tensor-parallel follower stopped following rank 0; the group cannot step any more."""


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to load its shard and join the group."""

    model_path: str
    dtype: torch.dtype
    device: str
    max_len: int
    config: EngineConfig  # the engine's: every rank builds its worker from it
    master_port: int
    bind_device: bool = True  # see tensor_parallel.can_bind_device


def _load_worker(rank: int, spec: RankSpec) -> Worker:
    tensor_parallel.init_distributed(
        rank,
        spec.config.tp_size,
        LOOPBACK,
        spec.master_port,
        spec.device,
        bind_device=spec.bind_device,
    )
    adapter = adapter_for_checkpoint(spec.model_path)
    model = tensor_parallel.load_model_for_rank(
        adapter, spec.model_path, tp_size=spec.config.tp_size, dtype=spec.dtype, device=spec.device
    )
    return Worker.from_config(
        model, spec.config, max_len=spec.max_len, sample=rank == 0, tensor_parallel=True
    )


def _broadcast(message: Any = None) -> Any:
    box = [message]
    dist.broadcast_object_list(box, src=0, group=tensor_parallel.control_group())
    return box[0]


class TPFollower:
    """Ranks 1..N-1: load a shard, then run whatever rank 0 broadcasts until told to stop."""

    def __init__(self, rank: int, spec: RankSpec):
        self.rank, self.spec = rank, spec
        # `kill -USR1 <pid>` writes this rank's Python stacks to its Ray worker log: where a
        # follower waits when the group hangs (Ray's own `ray stack` needs py-spy).
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    def gpu_uuids(self) -> list[str]:
        return visible_gpu_uuids()

    def load(self) -> bool:
        self.worker = _load_worker(self.rank, self.spec)
        return True

    def follow(self) -> int:
        """Serve rank 0's messages until "stop"; returns the number of steps run."""
        num_steps = 0
        while True:
            kind, payload = _broadcast()
            try:
                if kind == "execute":
                    self.worker.execute(payload)
                    num_steps += 1
                elif kind == "score":
                    self.worker.score(payload)
                elif kind == "load_weights":
                    self.worker.load_weights((n, torch.empty(s, dtype=d)) for n, s, d in payload)
                elif kind == "stop":
                    self.worker.release_cache()
                    tensor_parallel.shutdown_distributed()
                    return num_steps
            except Exception:
                log.exception("TP rank %d failed in %r after %d steps", self.rank, kind, num_steps)
                raise


class TPExecutor(Executor):
    """Rank 0 of a tensor-parallel group, in this process; see the module docstring."""

    def __init__(self, spec: RankSpec, *, num_cpus_per_rank: float = 1.0):
        import ray

        # A family without a plan fails here, before any rank exists or joins a group.
        tensor_parallel.tp_plan_for(adapter_for_checkpoint(spec.model_path), spec.config.tp_size)
        if not ray.is_initialized():
            ray.init()
        num_gpus = 1 if torch.device(spec.device).type == "cuda" else 0
        follower = ray.remote(TPFollower)
        group_id = uuid.uuid4().hex[:8]
        self.followers = [
            follower.options(
                # `ray list actors` shows which group and rank each follower is.
                name=f"{FOLLOWER_NAME_PREFIX}{group_id}-rank{rank}",
                num_cpus=num_cpus_per_rank,
                num_gpus=num_gpus,
                scheduling_strategy=_follower_strategy(rank, spec.config.tp_size),
            ).remote(rank, spec)
            for rank in range(1, spec.config.tp_size)
        ]
        try:
            if num_gpus:
                taken = ray.get([f.gpu_uuids.remote() for f in self.followers])
                spec = dataclasses.replace(spec, device=_rank0_device(spec.device, taken))
            loads = [f.load.remote() for f in self.followers]
            self.worker = _load_worker(0, spec)
            ray.get(loads)
        except BaseException:
            for actor in self.followers:
                ray.kill(actor)
            # NOTE: no barrier: the followers are gone. A group left behind would hang this
            # process's next collective.
            tensor_parallel.leave_distributed()
            raise
        self._loops = [f.follow.remote() for f in self.followers]
        self._stopped = False
        self._checked_at = time.monotonic()

    @classmethod
    def create(cls, spec_without_port: dict, **kwargs) -> TPExecutor:
        """A group on a free loopback port."""
        spec = RankSpec(
            **spec_without_port,
            master_port=_free_port(),
            bind_device=tensor_parallel.can_bind_device(),
        )
        return cls(spec, **kwargs)

    def execute(self, step: StepInput) -> StepOutput:
        self._check_followers()
        _broadcast(("execute", step.for_followers()))
        return self.worker.execute(step)

    def score(self, inputs: PromptInputs, num_top_logprobs: int = 0) -> TokenScores:
        self._check_followers()
        _broadcast(("score", inputs))  # the followers' share of the forward needs no more
        return self.worker.score(inputs, num_top_logprobs=num_top_logprobs)

    def check(self) -> None:
        """Raise FollowerLostError once a follower has stopped (from any thread: a Serve
        replica's health check calls it while the engine thread steps)."""
        self._check_followers(always=True)

    def _check_followers(self, *, always: bool = False) -> None:
        """Raise FollowerLostError (with the follower's own error) once a follower's loop has
        ended; looks at most every FOLLOWER_CHECK_S unless `always`."""
        import ray

        if not always and time.monotonic() - self._checked_at < FOLLOWER_CHECK_S:
            return
        self._checked_at = time.monotonic()
        ended, _ = ray.wait(self._loops, num_returns=len(self._loops), timeout=0)
        if not ended:
            return
        try:
            ray.get(ended)
            cause = "returned before rank 0 said stop"
        except Exception as error:  # noqa: BLE001 - reported as the cause
            cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        raise FollowerLostError(f"a tensor-parallel follower stopped following: {cause}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        updates = list(weights)
        self.worker.check_weights(updates)  # fail before any rank starts a collective
        self._check_followers(always=True)  # a weight update is rare: always look
        _broadcast(("load_weights", [(n, tuple(t.shape), t.dtype) for n, t in updates]))
        return self.worker.load_weights(updates)

    def shutdown(self) -> None:
        if self._stopped:
            return
        import ray

        self._stopped = True
        self.worker.release_cache()
        ended, _ = ray.wait(self._loops, num_returns=len(self._loops), timeout=0)
        if ended:  # a follower is gone: no collective can complete, so leave without one
            tensor_parallel.leave_distributed()
        else:
            _broadcast(("stop", None))
            tensor_parallel.shutdown_distributed()
            ray.get(self._loops, timeout=60)
        for actor in self.followers:
            ray.kill(actor)


def _rank0_device(device: str, taken: list[list[str]]) -> str:
    """Rank 0's GPU: `device` unless a follower holds it. Ray gives each follower a GPU of its
    own, but it cannot know which one rank 0 uses when rank 0 is not an actor holding one (a
    driver script that sees every GPU); rank 0 then takes one no follower has."""
    uuids = visible_gpu_uuids()
    used = {uuid for follower in taken for uuid in follower}
    index = torch.device(device).index or 0
    if uuids[index] not in used:
        return device
    free = [i for i, uuid in enumerate(uuids) if uuid not in used]
    if not free:
        raise ConfigError(
            f"tensor parallelism over NCCL needs one GPU per rank; rank 0 sees {len(uuids)} "
            "GPU(s), all held by the other ranks"
        )
    return f"cuda:{free[0]}"


def _follower_strategy(rank: int, tp_size: int) -> Any:
    import ray
    from ray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )

    group = ray.util.get_current_placement_group()
    if group is not None and len(group.bundle_specs) >= tp_size:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
    node_id = ray.get_runtime_context().get_node_id()
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]
