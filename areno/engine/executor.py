"""Executors carry the engine's step messages to the workers of one model replica.

`LocalExecutor` runs a single worker in the engine's process (`--tp-size 1`);
`areno.engine.parallel.RayTPExecutor` runs a tensor-parallel group of Ray actors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from areno.engine.outputs import TokenScores
from areno.engine.step import PendingStep, StepInput, StepOutput
from areno.engine.worker import Worker
from areno.processing.types import PromptInputs


class Executor(Protocol):
    """What the engine needs from the workers of one replica."""

    def execute(self, step: StepInput) -> StepOutput: ...

    def score(self, inputs: PromptInputs, num_top_logprobs: int = 0) -> TokenScores: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int: ...

    def check(self) -> None:
        """Raise if the workers can no longer step (callable from any thread)."""
        ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """One worker, in this process."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def execute(self, step: StepInput) -> StepOutput:
        return self.worker.execute(step)

    def launch(self, step: StepInput) -> PendingStep:
        """The step queued on the device; its result is read later (overlapped steps)."""
        return self.worker.launch(step)

    def score(self, inputs: PromptInputs, num_top_logprobs: int = 0) -> TokenScores:
        return self.worker.score(inputs, num_top_logprobs=num_top_logprobs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        return self.worker.load_weights(weights)

    def check(self) -> None:
        pass  # the worker is in this process: it lives as long as the engine

    def shutdown(self) -> None:
        self.worker.release_cache()
