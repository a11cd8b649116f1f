"""A simulated multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`), loopback only.

Each node is its own raylet with its own resources; a node is told apart by a custom resource
named after it. Test modules start one per module with `loopback_cluster(...)` and get the Ray
node id of every named node.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import ray
from ray import cluster_utils

from tests.ray_head import RAY_TEST_ENV as RAY_ENV
from tests.ray_head import free_port

__all__ = ["RAY_ENV", "LocalCluster", "free_port", "loopback_cluster"]


@dataclass
class LocalCluster:
    address: str  # the GCS address, for RAY_ADDRESS / ray.init
    dashboard: str | None  # http://127.0.0.1:PORT when started with the dashboard
    node_ids: dict[str, str]  # node name (= its custom resource) -> Ray node id


@contextlib.contextmanager
def loopback_cluster(nodes: dict[str, float], *, dashboard: bool = False) -> Iterator[LocalCluster]:
    """Start one node per entry of `nodes` (name -> CPUs; the first is the head), each with the
    custom resource `name` (amount 100, so any number of actors can ask for 1), connect this
    process as a driver, and stop everything at the end."""
    patch = pytest.MonkeyPatch()
    for key, value in RAY_ENV.items():
        patch.setenv(key, value)
    # NOTE: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import (the child processes get it
    # from the env var); this process imported Ray already, so its constant is set too.
    patch.setattr("ray._private.ray_constants.ENABLE_RAY_CLUSTER", False)
    if ray.is_initialized():
        ray.shutdown()
    (head, head_cpus), *others = nodes.items()
    head_args = {"num_cpus": head_cpus, "resources": {head: 100}, "include_dashboard": dashboard}
    dashboard_url = None
    if dashboard:
        port = free_port()
        head_args |= {"dashboard_host": "127.0.0.1", "dashboard_port": port}
        dashboard_url = f"http://127.0.0.1:{port}"
    made = cluster_utils.Cluster(initialize_head=True, head_node_args=head_args)
    try:
        node_ids = {head: made.head_node.node_id}
        for name, cpus in others:
            node_ids[name] = made.add_node(num_cpus=cpus, resources={name: 100}).node_id
        made.wait_for_nodes()
        ray.init(address=made.address, log_to_driver=False)
        yield LocalCluster(made.address, dashboard_url, node_ids)
    finally:
        ray.shutdown()
        made.shutdown()
        patch.undo()
