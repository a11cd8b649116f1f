"""ProgramWorker: a rollout worker whose episodes are an agent program's runs.

Each of a group's G episodes runs the program as an asyncio task on the worker's own event loop,
beside its engine, with a client of its own episode's route (areno.programs.route); when it
returns, its recorded calls become trajectories (areno.rollout.calls). A group's episodes are
bounded like any group's: G tasks, each ending by `rollout.program_timeout_s`, each making at
most `rollout.program_max_calls` calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from areno.data.sample import PublicSample
from areno.engine.sampling import SamplingParams
from areno.programs.program import load_program, portable_output
from areno.programs.route import EpisodeRoute, RouteLimits
from areno.rollout.calls import ProgramEpisode, trajectories_from_calls
from areno.rollout.worker import GroupResult, RolloutSpec, RolloutWorker, engine_seconds

logger = logging.getLogger("areno.programs")


class ProgramWorker(RolloutWorker):
    """A RolloutWorker (same parts, weights and calls) whose `run_group` runs the program."""

    def __init__(self, spec: RolloutSpec):
        super().__init__(spec)
        self.program = load_program(spec.program)
        limits = RouteLimits(spec.max_tokens_per_turn, spec.program_max_calls)
        self.route = EpisodeRoute(self.env, limits)

    async def run_group(
        self,
        sample_id: str | None,
        messages: list[dict],
        group_size: int,
        sampling: SamplingParams,
        tools: list[dict] | None = None,
    ) -> GroupResult:
        """`group_size` runs of the program on one public sample, concurrently; their
        trajectories. A group none of whose episodes made a call is skipped, with the first
        episode's error (a program that fails on this sample, or on every sample)."""
        start = time.perf_counter()
        await self.route.start()
        sample = PublicSample(sample_id, messages, tools)
        runs = [self._run_program(sample, index, sampling) for index in range(group_size)]
        episodes = await asyncio.gather(*runs)
        timings = {"generate_s": time.perf_counter() - start}
        if not any(episode.calls for episode in episodes):
            why = next((e.error for e in episodes if e.error), "the program made no call")
            return GroupResult([], timings, f"no episode of the program made a call: {why}")
        trajectories = [t for e in episodes for t in trajectories_from_calls(sample_id, e)]
        return GroupResult(trajectories, timings, engine=engine_seconds(self.env.generator))

    async def _run_program(
        self, sample: PublicSample, index: int, sampling: SamplingParams
    ) -> ProgramEpisode:
        """One run of the program; an error or a timeout ends the episode, not the group. With
        drained weight updates, an update waits for the whole run (`sampling_episode`), so
        every call of an episode is sampled by one policy."""
        episode = ProgramEpisode(index)
        seed = None if sampling.seed is None else sampling.seed + 7919 * index
        base_url = self.route.open(episode, dataclasses.replace(sampling, seed=seed))
        # each episode its own copy: a program that edits its sample changes no other episode's
        own = PublicSample(**sample.to_dict())
        try:
            async with self.sampling_episode():
                output = await asyncio.wait_for(
                    self.program.run(own, base_url), self.spec.program_timeout_s
                )
            episode.output = portable_output(output)
        except TimeoutError:
            episode.finish = "timeout"
            episode.error = f"no output within {self.spec.program_timeout_s} s"
        except Exception as error:  # noqa: BLE001 - the program's own failure ends its episode
            episode.finish, episode.error = "error", f"{type(error).__name__}: {error}"
            logger.warning("agent program failed on sample %r: %s", sample.id, episode.error)
        finally:
            self.route.close(base_url)
        return episode
