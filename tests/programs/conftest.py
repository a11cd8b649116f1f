from tests.ray_head import ray_head  # noqa: F401 (a fixture)
