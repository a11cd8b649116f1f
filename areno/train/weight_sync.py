"""Trainer -> generator weight sync.

After each optimizer step the trainable parameters (the frozen towers never change, so they are
not sent) go to every rollout worker, which loads them in place between two engine steps and
takes the new policy version: at once, its episodes in flight going on under them
(rollout.partial_rollouts), or once those have ended (`RolloutWorker.update_weights`). Two
transports:
- "object_store": rank 0 copies the parameters to host memory and puts them in Ray's object
  store once; every worker, on any node, reads them from there.
- "cuda_ipc": when every rollout worker shares rank 0's GPU (colocated GRPO with fractional GPUs),
  rank 0 sends CUDA IPC handles of its parameters and each worker copies device to device; no
  host copy. Needs whole parameters on rank 0 (ZeRO-0/1/2).
A LoRA policy (areno/train/lora.py) sends only its adapters' factors, through the object store
(a few MB even for a large model), and the workers load them beside their base weights.
`WeightSync` also brings a restarted rollout worker (which comes back with the checkpoint it was
built from) to the current policy.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from areno.engine.parallel.ipc import CudaIpcWeights, device_uuid
from areno.errors import ConfigError
from areno.train.lora import is_lora, policy_adapter
from areno.train.rollouts import RolloutWorkerLostError, wait_all, wait_for_workers

logger = logging.getLogger("areno.train")

Named = list[tuple[str, torch.nn.Parameter]]


def gathered(params: list[torch.nn.Parameter], zero_stage: int):
    """A context in which ZeRO-3 partitioned parameters are whole on every rank."""
    if zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def trainable_named(module: torch.nn.Module) -> Named:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def host_copies(named: Named) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", copy=True) for n, p in named}


def choose_transport(
    requested: str, module: torch.nn.Module, zero_stage: int, workers: Sequence[Any]
) -> str:
    """ "object_store" or "cuda_ipc" for `requested` ("auto" picks cuda_ipc where it works)."""
    if requested == "object_store":
        return requested
    if is_lora(module):
        if requested == "cuda_ipc":
            raise ConfigError(
                "trainer.weight_sync=cuda_ipc is not offered for LoRA: the adapters' factors go "
                "through the object store"
            )
        return "object_store"
    import ray

    param = next(module.parameters())
    reasons = []
    if not param.is_cuda:
        reasons.append(f"the trainer's parameters are on {param.device}")
    elif zero_stage == 3:
        reasons.append("ZeRO-3 partitions the parameters over the trainer ranks")
    else:
        sender = device_uuid(param.device.index)
        seen = ray.get([w.gpu_uuids.remote() for w in workers])
        away = [i for i, uuids in enumerate(seen) if sender not in uuids]
        if away:
            reasons.append(f"rollout workers {away} do not share the trainer's GPU {sender}")
    if not reasons:
        return "cuda_ipc"
    if requested == "cuda_ipc":
        raise ConfigError(f"trainer.weight_sync=cuda_ipc is impossible: {reasons[0]}")
    return "object_store"


class WeightSync:
    """Rank 0's sender of the trainable weights to the rollout workers.

    It knows the policy version it last sent, so `restore()` can bring a restarted worker back
    to it mid-step. Under ZeRO-2 and below rank 0 holds whole parameters and re-reads them from
    `module`; under ZeRO-3 only a collective of every rank could gather them again, so the
    object-store copy of the last push is kept until the next one (one copy of the trainable
    weights).
    """

    def __init__(
        self,
        workers: Sequence[Any],
        module: torch.nn.Module,
        zero_stage: int,
        max_retries: int,
        transport: str = "auto",
    ) -> None:
        self.workers = list(workers)
        self.module, self.zero_stage, self.max_retries = module, zero_stage, max_retries
        self.transport = choose_transport(transport, module, zero_stage, self.workers)
        self.version: int | None = None
        self._kept: Any = None  # ObjectRef of the last push (ZeRO-3 only)

    def push(self, named: Named, version: int) -> float:
        """Send the parameters `named` (whole, on rank 0) as policy `version` to every worker;
        returns seconds taken."""
        start = time.perf_counter()
        payload = self._payload(named)
        self.version = version
        self._kept = payload if self.zero_stage == 3 else None
        self._send(list(range(len(self.workers))), payload)
        return time.perf_counter() - start

    def advance(self, version: int) -> float:
        """Tell every worker that policy `version` holds the weights they already have (a step
        that took no optimizer step); returns seconds taken. Nothing is gathered or sent."""
        start = time.perf_counter()
        self.version = version
        self._send(list(range(len(self.workers))), [])
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

    def _payload(self, named: Named) -> Any:
        if self.transport == "cuda_ipc":
            return CudaIpcWeights.share(named)
        import ray

        if is_lora(self.module):
            return ray.put(policy_adapter(self.module, host_copies(named)))
        return ray.put(host_copies(named))

    def _current(self) -> Any:
        if self._kept is not None:
            return self._kept
        return self._payload(trainable_named(self.module))

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
