"""Choice of the weight-sync transport (the CUDA IPC path itself runs in tests/engine/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from areno.errors import ConfigError
from areno.train.config import TrainerConfig
from areno.train.weight_sync import choose_transport


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
