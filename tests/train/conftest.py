"""Training tests share the module-scoped Ray head of tests/ray_head.py; the trainer's own
`Learner` runs in a one-rank gloo group of the test process (`process_group`), one for the
session: DeepSpeed keeps the first group it is given for the life of the process."""

import os
import socket

import pytest

from tests.ray_head import ray_head  # noqa: F401 (a fixture)


@pytest.fixture(scope="session")
def process_group():
    import torch.distributed as dist

    # A group some earlier test left behind would hang DeepSpeed's first collective.
    assert not dist.is_initialized(), "an earlier test left torch.distributed initialized"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    env["LOCAL_RANK"] = "0"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
