"""Training across nodes: `areno train`, launched as a user launches it on a cluster (a driver
that joins the running Ray), with its rollout workers and its trainer workers placed by
`rollout.resources_per_worker` / `trainer.resources_per_worker` on two different nodes, runs a
few GRPO steps: rollouts, rewards, DeepSpeed updates and weight sync from one node to the other.

Where each actor ran comes from Ray's own actor table, not from anything AReno reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ray.util import state

from areno.train.metrics import read_metrics
from tests.cluster.multinode import RAY_ENV, loopback_cluster

REPO = Path(__file__).resolve().parents[2]
STEPS = 2


@pytest.fixture(scope="module")
def cluster():
    # The head hosts the trainer (and the driver); the "rollout" node the rollout worker.
    with loopback_cluster({"trainer": 1, "rollout": 1}, dashboard=True) as made:
        yield made


def train(cluster, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        **RAY_ENV,
        RAY_ADDRESS=cluster.address,
        ARENO_CACHE_DIR=str(tmp_path / "cache"),
        PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    )
    command = [sys.executable, "-m", "areno.cli", "train", "--no-progress", *args]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return result


def actor_nodes(cluster, class_name: str) -> set[str]:
    """The Ray node ids every actor of `class_name` ran on (alive or not), from Ray's state."""
    actors = state.list_actors(
        address=cluster.dashboard, filters=[("class_name", "=", class_name)], detail=True
    )
    return {actor.node_id for actor in actors}


def test_rollout_and_trainer_workers_train_on_different_nodes(cluster, tiny_path, tmp_path):
    run_dir = tmp_path / "run"
    result = train(
        cluster,
        tmp_path,
        *("--config", str(REPO / "configs" / "color_quiz.yaml")),
        *("--model-path", str(tiny_path("qwen3_5")), "--run-dir", str(run_dir)),
        *("--max-steps", str(STEPS), "--group-size", "2", "--prompts-per-step", "2"),
        *("--eval-every", "0", "--set", "run.export_hf=false"),
        *("--set", "data.loader_kwargs={num_samples: 8}"),
        *("--set", "rollout.num_cpus_per_worker=0.5", "--set", "trainer.num_cpus_per_worker=0.5"),
        *("--set", "rollout.resources_per_worker={rollout: 1}"),
        *("--set", "trainer.resources_per_worker={trainer: 1}"),
        # serial steps: step 2's rollout starts once step 1's weights have crossed the nodes
        *("--set", "rollout.max_staleness=0"),
    )
    assert "areno train: done" in result.stdout

    records = read_metrics(run_dir)
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    # step 2's rollouts ran on step 1's weights: the update crossed from one node to the other
    assert steps[-1]["policy_version"] == STEPS - 1
    assert all(r["rollout_tokens_per_s"] > 0 and r["train_s"] > 0 for r in steps)

    nodes = cluster.node_ids
    assert nodes["rollout"] != nodes["trainer"]
    assert actor_nodes(cluster, "RolloutWorker") == {nodes["rollout"]}
    assert actor_nodes(cluster, "RayTrainWorker") == {nodes["trainer"]}
