"""Choice of the weight-sync transport (the CUDA IPC path itself runs in tests/engine/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from areno.errors import ConfigError
from areno.train.config import TrainerConfig
from areno.train.weight_sync import WeightSync, choose_transport, trainable_named


def test_cpu_trainer_sends_through_the_object_store():
    module = torch.nn.Linear(4, 4)
    assert choose_transport("auto", module, 2, workers=[]) == "object_store"
    assert choose_transport("object_store", module, 2, workers=[]) == "object_store"


def test_cuda_ipc_asked_where_impossible_names_the_reason():
    with pytest.raises(
        ConfigError, match="cuda_ipc is impossible: the trainer's parameters are on cpu"
    ):
        choose_transport("cuda_ipc", torch.nn.Linear(4, 4), 2, workers=[])


def test_unknown_transport_is_a_config_error():
    with pytest.raises(ConfigError, match="trainer.weight_sync must be one of"):
        TrainerConfig(weight_sync="nccl")


def test_a_step_without_an_optimizer_step_moves_only_the_version(tiny_path):
    """After a skipped update the workers learn the new policy version and keep their weights:
    nothing is gathered or sent, and restore() finds no worker behind."""
    import ray

    from areno.engine.config import EngineConfig
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
        sync.advance(2)
        assert ray.get(worker.policy_version.remote()) == 2
        assert sync.restore() == []
    finally:
        ray.shutdown()
