"""How new weights reach a rollout worker's episodes in flight (`rollout.partial_rollouts`), on a
real tiny checkpoint and engine: drained, an update waits for the episodes in flight and holds
the ones that would start, so each episode is one policy's; partial, the episodes go on under
the new weights, each token stamped with the version that sampled it and carrying that policy's
logprob, through Episode and Trajectory as the trainer receives them.

The run through `areno train` (the versions reaching the trainer's staleness bound, metrics and
loss, and a resume) is tests/train/test_partial_rollouts.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areno.engine.config import EngineConfig
from areno.engine.sampling import SamplingParams
from areno.models.tiny import build_tiny
from areno.rollout.trajectory import Trajectory
from areno.rollout.worker import RolloutSpec, RolloutWorker
from areno.train.policy import sequence_logprobs

MESSAGES = [{"role": "user", "content": "Name every color you know."}]
TOKENS = 40  # sampled by each episode (EOS ignored): long enough to outlast an update
# seeded sampling at temperature 1: the rollout's logprobs are the policy's own
SAMPLING = SamplingParams(temperature=1.0, ignore_eos=True, seed=11)


@pytest.fixture(scope="module")
def models(tiny_path):
    """The checkpoint the workers start from (policy 0) and the weights of policy 1."""
    from areno.processing.processor import Processor

    path = tiny_path("qwen3_5")
    other = build_tiny("qwen3_5", path.parent / "qwen3_5-seed1", seed=1)
    processor = Processor(path)
    loaded = {v: processor.adapter.load_model(p).eval() for v, p in ((0, path), (1, other))}
    return path, loaded


def _worker(path, partial: bool) -> RolloutWorker:
    engine = EngineConfig(max_running_prompts=4, max_context_len=256)
    return RolloutWorker(
        RolloutSpec(str(path), engine, max_tokens_per_turn=TOKENS, partial_rollouts=partial)
    )


def _policy_1(worker: RolloutWorker, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {n for n, _ in worker.env.generator.core.executor.model.named_parameters()}
    return {n: w for n, w in model.state_dict().items() if n in names}


async def _running(worker: RolloutWorker, num_episodes: int) -> None:
    """Until the engine runs every episode's request (each has sampled its first token)."""
    while worker.env.generator.stats()["num_running"] < num_episodes:
        await asyncio.sleep(0.005)


def test_a_drained_update_waits_for_the_episodes_in_flight_and_holds_new_ones(models):
    path, loaded = models
    worker = _worker(path, partial=False)
    weights = _policy_1(worker, loaded[1])

    async def main():
        before = asyncio.create_task(worker.run_group("a", MESSAGES, 2, SAMPLING))
        await _running(worker, 2)
        update = asyncio.create_task(worker.update_weights(weights, 1))
        await asyncio.sleep(0)  # the update is waiting before the next group arrives
        after = asyncio.create_task(worker.run_group("b", MESSAGES, 2, SAMPLING))
        return await before, await after, await update

    try:
        before, after, count = asyncio.run(main())
    finally:
        worker.shutdown()
    assert count == len(weights) and worker.policy_version() == 1
    for trajectory in before.trajectories:
        assert trajectory.token_versions == [0] * TOKENS
    for trajectory in after.trajectories:
        assert trajectory.token_versions == [1] * TOKENS


def test_with_partial_rollouts_an_episode_spans_two_policies_token_by_token(models):
    """The update lands while the engine holds the episodes mid-turn (paused, kept in their
    slots), so each episode has tokens of both policies; every sampled token's rollout logprob
    is the logprob of the policy its version names, given the whole prefix."""
    path, loaded = models
    worker = _worker(path, partial=True)
    generator = worker.env.generator
    weights = _policy_1(worker, loaded[1])

    async def main():
        group = asyncio.create_task(worker.run_group("a", MESSAGES, 2, SAMPLING))
        await _running(worker, 2)
        await generator.pause("keep")
        await worker.update_weights(weights, 1)  # not waiting for the episodes held
        await generator.resume()
        return await group

    try:
        result = asyncio.run(main())
    finally:
        worker.shutdown()
    assert len(result.trajectories) == 2
    for trajectory in result.trajectories:
        versions = trajectory.token_versions
        switch = versions.index(1)
        assert switch > 0 and versions == [0] * switch + [1] * (TOKENS - switch)
        _assert_logprobs_of_their_versions(trajectory, loaded)


def _assert_logprobs_of_their_versions(traj: Trajectory, loaded: dict) -> None:
    n = traj.num_prompt_tokens
    assert traj.loss_mask == [0] * n + [1] * TOKENS  # every sampled token trains
    with torch.no_grad():
        expected = {v: sequence_logprobs(m, traj.inputs, "cpu", n) for v, m in loaded.items()}
    sampled = traj.rollout_logprobs[n:]
    for i, (version, logprob) in enumerate(zip(traj.token_versions, sampled, strict=True)):
        assert logprob == pytest.approx(expected[version][i].item(), abs=1e-4), (i, version)
