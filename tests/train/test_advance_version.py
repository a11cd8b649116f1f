"""`WeightSync.advance`: a training step without an optimizer step, against a real rollout worker
actor. (Its own module, early in the run: an in-process Ray session just before the interpreter
exits segfaulted the pytest process once in CI.)"""

from __future__ import annotations

import torch

from areno.train.weight_sync import WeightSync, trainable_named


def test_a_step_without_an_optimizer_step_moves_only_the_version(tiny_path):
    """After a skipped update the workers learn the new policy version and keep the weights they
    have (the trainer's, changed after the push, are not sent), and restore() finds no worker
    behind."""
    import ray

    from areno.engine.config import EngineConfig
    from areno.engine.sampling import SamplingParams
    from areno.rollout.worker import RolloutSpec, RolloutWorker
    from areno.train.policy import load_policy

    path = str(tiny_path("qwen3_5"))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        spec = RolloutSpec(path, EngineConfig(max_running_prompts=2, max_context_len=128))
        worker = ray.remote(RolloutWorker).remote(spec)
        model, _, _ = load_policy(path, dtype=torch.float32)
        sync = WeightSync([worker], model, zero_stage=2, max_retries=0)
        sync.push(trainable_named(model), 1)
        assert ray.get(worker.policy_version.remote()) == 1

        def greedy_tokens() -> list[int]:
            messages = [{"role": "user", "content": "Name a color."}]
            params = SamplingParams(temperature=0, max_tokens=8)
            result = ray.get(worker.run_group.remote("s", messages, 1, params))
            return result.trajectories[0].token_ids

        before = greedy_tokens()
        with torch.no_grad():  # what a wrongly sent update would carry
            for _, param in trainable_named(model):
                param.zero_()
        sync.advance(2)
        assert ray.get(worker.policy_version.remote()) == 2
        assert greedy_tokens() == before
        assert sync.restore() == []
    finally:
        ray.shutdown()
