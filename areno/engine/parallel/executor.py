"""Executors carry the engine's step messages to the workers of one model replica.

`LocalExecutor` runs a single worker in the engine's process (`--tp-size 1`);
`areno.engine.parallel.tp_executor.TPExecutor` runs rank 0 of a tensor-parallel group here and the other
ranks as Ray actors. Both answer what the engine asks of the replica (its device, vocabulary,
pool, LoRA adapters, media cache) from the worker in this process (`Executor`): nothing else
reads an executor's worker.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable

import torch

from areno.engine.layers.lora import LoraWeights
from areno.engine.outputs import TokenScores
from areno.engine.parallel.kv_pool import KVPool
from areno.engine.parallel.worker import CompiledPaths, Worker
from areno.engine.runner.model_runner import ModelRunner
from areno.engine.step import PendingStep, StepInput, StepOutput
from areno.processing.types import PromptInputs


class Executor(abc.ABC):
    """The workers of one replica, as the engine sees them: the steps they run (abstract) and
    what it asks of the replica (its device, vocabulary, pool, LoRA adapters, media cache),
    answered by the worker in this process, rank 0."""

    worker: Worker

    @abc.abstractmethod
    def execute(self, step: StepInput) -> StepOutput: ...

    @abc.abstractmethod
    def score(self, inputs: PromptInputs, num_top_logprobs: int = 0) -> TokenScores: ...

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int: ...

    @abc.abstractmethod
    def check(self) -> None:
        """Raise if the workers can no longer step (callable from any thread)."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    @property
    def device(self) -> torch.device:
        return self.worker.device

    @property
    def model(self) -> torch.nn.Module:
        return self.worker.model

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's model runner: its caches, graphs and compiled paths, for the checks of tests
        and benchmarks (the engine asks the methods below)."""
        return self.worker.runner

    @property
    def vocab_size(self) -> int:
        """The width of the logits the sampler draws from."""
        return self.worker.vocab_size

    @property
    def pool(self) -> KVPool:
        return self.worker.pool

    @property
    def caches_prefixes(self) -> bool:
        return self.worker.caches_prefixes

    @property
    def num_state_rows(self) -> int:
        return self.worker.num_state_rows

    @property
    def default_adapter(self) -> str | None:
        return self.worker.default_adapter

    def whole_runs(self, inputs: PromptInputs) -> list[tuple[int, int]]:
        return self.worker.whole_runs(inputs)

    def adapter_index(self, name: str | None) -> int:
        return self.worker.adapter_index(name)

    def load_adapter(self, name: str, weights: LoraWeights, *, default: bool = False) -> int:
        """LoRA needs tp_size 1 (EngineConfig refuses more): the worker is the whole replica."""
        return self.worker.load_adapter(name, weights, default=default)

    def score_with_adapter(
        self, inputs: PromptInputs, adapter: str | None, num_top_logprobs: int = 0
    ) -> TokenScores:
        """`score` under LoRA adapter `adapter` (tp_size 1, as `load_adapter`)."""
        return self.worker.score(inputs, adapter, num_top_logprobs)

    def media_cache_stats(self) -> tuple[int, int, float]:
        return self.worker.media_cache_stats()

    def compiled_paths(self) -> CompiledPaths:
        return self.worker.compiled_paths()


class LocalExecutor(Executor):
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

    def share_part_prefills(self, shared: bool) -> None:
        """Whether parts of prompts (resumptions, chunks) share forwards, where the runner can
        (its default); a benchmark's baseline runs each part alone."""
        self.worker.shares_part_prefills = shared and self.worker.runner.can_prefill_parts

    @property
    def shares_part_prefills(self) -> bool:
        return self.worker.shares_part_prefills

    @Executor.default_adapter.setter
    def default_adapter(self, name: str | None) -> None:
        """The adapter of requests that name none (None: the base model)."""
        if name is not None:
            self.worker.adapter_index(name)  # raises for an adapter never loaded
        self.worker.default_adapter = name
