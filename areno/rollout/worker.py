"""RolloutWorker: the serving classes (MediaDecoder, Processor, Generator) in one Ray actor.

Run as `ray.remote(RolloutWorker)`; the GRPO trainer calls `run_group` for each prompt of a step
and `update_weights` after each optimizer step. It only ever sees PUBLIC samples: private
metadata stays with the trainer, which computes rewards.

Weights land in one of two ways (`RolloutSpec.partial_rollouts`). Partial rollouts: at once,
between two engine steps; the episodes in flight go on under them, each token stamped with the
version that sampled it. Drained: the update waits for the worker's episodes in flight to end,
and episodes that would start meanwhile wait for the update (`EpisodeGate`), so every episode is
sampled by one policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from areno.engine.config import EngineConfig
from areno.engine.generator import Generator
from areno.engine.parallel.ipc import visible_gpu_uuids
from areno.engine.sampling import SamplingParams
from areno.media.decoder import MediaDecoder
from areno.media.sources import MediaPolicy
from areno.processing.encode import SAMPLE_ERRORS, PromptLimits, sample_error_text
from areno.processing.processor import Processor
from areno.processing.types import PromptInputs
from areno.rollout.agent import ToolContext, load_agent
from areno.rollout.episode import EpisodeLimits, RolloutEnv, encode_prompt, run_episode
from areno.rollout.trajectory import Trajectory
from areno.tools.registry import get_tool_parser


@dataclass(frozen=True)
class RolloutSpec:
    """Everything a rollout worker needs to build its parts (picklable, sent to the actor)."""

    model_path: str
    engine: EngineConfig
    agent: str | None = None  # import path "module:callable" of an Agent factory
    agent_kwargs: dict = field(default_factory=dict)
    # an agent program instead of an agent (areno.programs; its worker is a ProgramWorker)
    program: str | None = None
    program_max_calls: int = 16
    program_timeout_s: float = 600.0
    max_prompt_tokens: int | None = None
    max_tokens_per_turn: int = 256
    allow_remote_media: bool = False
    # torch's CPU compute threads (None: its default, every core): an overlapped GRPO loop
    # gives the rollout and the trainer their own share of the cores
    cpu_threads: int | None = None
    # new weights land mid-episode (rollout.partial_rollouts); else an update drains first
    partial_rollouts: bool = False


@dataclass
class GroupResult:
    """A group's episodes (`run_group`), or none and why its sample was skipped."""

    trajectories: list[Trajectory]
    timings: dict[str, float]  # the group's wall seconds: encode_s, then generate_s
    skipped: str | None = None  # the sample's error: "MediaNotFoundError: media file not found..."
    # seconds of work per phase (its episodes' summed: they run concurrently): media_s,
    # process_s, generate_s, tools_s, tool_inputs_s (`run_episode`)
    phases: dict[str, float] = field(default_factory=dict)
    # the engine's seconds so far when the group ended (`engine_seconds`)
    engine: dict[str, float] = field(default_factory=dict)


ENGINE_SECONDS = ("prefill_s", "decode_s", "media_encode_s")


def engine_seconds(generator: Generator) -> dict[str, float]:
    """The engine's seconds so far of steps that prefilled, decode-only steps and media tower
    calls (`Generator.stats`)."""
    stats = generator.stats()
    return {key: float(stats[key]) for key in ENGINE_SECONDS}


class EpisodeGate:
    """Drained weight updates: an update waits until no episode is in flight and holds the
    episodes that would start meanwhile until it is done."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._num_running = 0
        self._updating = False

    @contextlib.asynccontextmanager
    async def episode(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._updating)
            self._num_running += 1
        try:
            yield
        finally:
            async with self._changed:
                self._num_running -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def update(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._updating)  # one update at a time
            self._updating = True
            await self._changed.wait_for(lambda: self._num_running == 0)
        try:
            yield
        finally:
            async with self._changed:
                self._updating = False
                self._changed.notify_all()


class RolloutWorker:
    """One generator replica plus its decoder and processor; runs GRPO groups of episodes."""

    def __init__(self, spec: RolloutSpec):
        self.spec = spec
        if spec.cpu_threads is not None:
            import torch

            torch.set_num_threads(spec.cpu_threads)
        # the agent first: its error comes before the engine's start (minutes on a GPU)
        self.agent = load_agent(spec.agent, **spec.agent_kwargs)
        max_context_len = spec.engine.max_context_len
        processor = Processor(
            spec.model_path, limits=PromptLimits(spec.max_prompt_tokens, max_context_len)
        )
        decoder = MediaDecoder(
            MediaPolicy.for_training(allow_remote=spec.allow_remote_media),
            processor.decode_options(),
        )
        generator = Generator.from_config(spec.model_path, spec.engine)
        parser = get_tool_parser(processor.adapter.tool_format)
        self.env = RolloutEnv(decoder, processor, generator, parser)
        self.limits = EpisodeLimits(generator.max_context_len, spec.max_tokens_per_turn)
        self._gate = EpisodeGate()

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else os.uname()[1]

    async def run_group(
        self,
        sample_id: str | None,
        messages: list[dict],
        group_size: int,
        sampling: SamplingParams,
        tools: list[dict] | None = None,
    ) -> GroupResult:
        """`group_size` episodes of one public sample (its messages and tools), run
        concurrently; the prompt is decoded and encoded once for the group. Returns the
        trajectories and timings, or none when the sample's own content failed its prompt or
        an episode (SAMPLE_ERRORS: the group is skipped, the error says why)."""
        start = time.perf_counter()
        phases: dict[str, float] = {}
        try:
            prompt = await encode_prompt(self.env, self.agent, messages, tools, sample_id, phases)
        except SAMPLE_ERRORS as error:
            return GroupResult(
                [], {"encode_s": time.perf_counter() - start}, sample_error_text(error), phases
            )
        encoded = time.perf_counter()
        episodes = [
            self._episode(ToolContext(sample_id, messages, index), prompt, sampling, phases)
            for index in range(group_size)
        ]
        # Every episode ends before the group does, failed or not: none keeps running unseen.
        results = await asyncio.gather(*episodes, return_exceptions=True)
        timings = {"encode_s": encoded - start, "generate_s": time.perf_counter() - encoded}
        errors = [r for r in results if isinstance(r, BaseException)]
        if bad := [e for e in errors if not isinstance(e, SAMPLE_ERRORS)]:
            raise bad[0]
        engine = engine_seconds(self.env.generator)
        if errors:
            return GroupResult([], timings, sample_error_text(errors[0]), phases, engine)
        return GroupResult(list(results), timings, phases=phases, engine=engine)

    async def _episode(
        self,
        ctx: ToolContext,
        prompt: PromptInputs,
        sampling: SamplingParams,
        phases: dict[str, float],
    ) -> Trajectory:
        async with self.sampling_episode():
            return await run_episode(
                self.env, self.agent, ctx, prompt, sampling, self.limits, phases
            )

    def sampling_episode(self) -> contextlib.AbstractAsyncContextManager:
        """Held while an episode samples: with drained updates (no partial rollouts) an update
        waits for it to end, and it waits for an update under way to land first."""
        if self.spec.partial_rollouts:
            return contextlib.nullcontext()
        return self._gate.episode()

    async def update_weights(self, weights: Any, version: int) -> int:
        """Load new trainable weights in place (Ray resolves an ObjectRef argument here): at
        once with partial rollouts, else once the episodes in flight have ended (the module's
        docstring)."""
        if self.spec.partial_rollouts:
            return await self.env.generator.update_weights(weights, version)
        async with self._gate.update():
            return await self.env.generator.update_weights(weights, version)

    def policy_version(self) -> int:
        return self.env.generator.policy_version

    def gpu_uuids(self) -> list[str]:
        """The GPUs this worker's generator sees (the trainer shares weights by CUDA IPC with
        workers on its own GPU)."""
        return visible_gpu_uuids()

    def stats(self) -> dict[str, Any]:
        return {**self.env.generator.stats(), **self.env.decoder.cache_info()}

    def shutdown(self) -> None:
        self.env.generator.shutdown()
        self.env.processor_thread.shutdown(wait=False)
