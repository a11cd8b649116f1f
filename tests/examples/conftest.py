"""Example smoke tests share the module-scoped Ray head of tests/ray_head.py."""

from tests.ray_head import ray_head  # noqa: F401 (a fixture)
