"""Trainer -> generator weight sync through the Ray object store.

After each optimizer step the trainable parameters (the frozen towers never change, so they are
not sent) go to every rollout worker, which loads them in place between two engine steps and
takes the new policy version.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch


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


def push_weights(workers: Sequence[Any], state: dict[str, torch.Tensor], version: int) -> float:
    """Send `state` to every rollout worker (one object-store copy); returns seconds taken."""
    import ray

    start = time.perf_counter()
    ref = ray.put(state)
    ray.get([worker.update_weights.remote(ref, version) for worker in workers])
    return time.perf_counter() - start
