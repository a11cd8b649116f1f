"""The RL recipes through `areno train` on a Ray head (as test_bad_samples.py runs it): DAPO's
dynamic sampling drops the groups whose rewards are all equal and draws replacements beside the
next step's rollout in flight, a step that reaches grpo.max_extra_prompts trains what it kept
and says so; the run trains GSPO's sequence-level ratio under IcePop's mask; its metrics reach
TensorBoard, Weights & Biases (offline) and MLflow as they reach metrics.jsonl; a tracker whose
package is missing is refused before Ray starts, naming the extra to install.

The loss math of each recipe is tests/train/test_grpo.py's, its wiring through the trainer's
Learner tests/train/test_off_policy.py's."""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from areno.train.metrics import read_metrics
from tests.train.dynamic_task import FLAT_REWARD

REPO = Path(__file__).resolve().parents[2]
RUN_LIMIT_S = 900
# The stream, in order (unshuffled): 0 live, 1-6 flat, then live. Two prompts a step, at most
# two extra prompts a step; the first step's rollout runs alone, then the next step's is in
# flight beside each step (max_staleness 1):
#   step 1 draws 0, 1; drops 1, draws 2 then 3 (both flat) and is out of extra prompts: it
#     trains 0's group alone (unfilled); step 2's rollout then draws 4, 5
#   step 3's rollout draws 6, 7; step 2 drops 4 and 5, draws 8 and 9 in one round: filled
#   step 3 drops 6, draws 10: filled
FLAT = [1, 2, 3, 4, 5, 6]
EXPECTED = {  # step: (prompts drawn, groups dropped, replacement rounds, unfilled)
    1: ([0, 1, 2, 3], [1, 2, 3], 2, 1.0),
    2: ([4, 5, 8, 9], [4, 5], 1, 0.0),
    3: ([6, 7, 10], [6], 1, 0.0),
}
OPTIONAL = [name for name in ("wandb", "mlflow") if importlib.util.find_spec(name)]


def _areno_train(ray_head, run_dir: Path, model: Path, settings: dict, env: dict | None = None):
    args = [
        *("--model-path", str(model), "--run-dir", str(run_dir), "--max-steps", "3"),
        *("--group-size", "4", "--prompts-per-step", "2", "--eval-every", "0"),
    ]
    for key, value in settings.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    # cwd=REPO: Ray puts the driver's working directory on its workers' path, so they import
    # tests.train.dynamic_task. `env` is the driver's alone (the head started before): the
    # trackers' variables reach rank 0 through the driver.
    return subprocess.run(
        [sys.executable, "-m", "areno.cli", "train", "--no-progress", *args],
        cwd=REPO, env={**ray_head.env, **(env or {})}, capture_output=True, text=True,
        timeout=RUN_LIMIT_S,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(ray_head, tiny_path, tmp_path_factory):
    """One three-step run: dynamic sampling, GSPO under IcePop's mask, every tracker installed."""
    root = tmp_path_factory.mktemp("recipes")
    run_dir = root / "run"
    settings = {
        "reward": "tests.train.dynamic_task:reward",
        "data.loader": "tests.train.dynamic_task:load",
        "data.loader_kwargs": {"num_samples": 32, "flat": FLAT},
        "data.shuffle": False,
        "rollout.engine": {"max_running_prompts": 16, "max_context_len": 128},
        "rollout.max_tokens_per_turn": 2,
        "rollout.max_staleness": 1,
        "rollout.num_cpus_per_worker": 0.5,
        "trainer.num_cpus_per_worker": 0.5,
        "grpo.dynamic_sampling": True,
        "grpo.max_extra_prompts": 2,
        "grpo.behaviour_logprobs": "recompute",
        "grpo.loss": {
            "ratio_level": "sequence",
            "loss_agg": "seq_mean_token_mean",
            "rollout_correction": "mask",
        },
        "run.export_hf": False,
        "run.loggers": ["tensorboard", *OPTIONAL],
        "run.project": "areno-recipes",
    }
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        # MLflow's local file store (the skinny client has no database store)
        "MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }
    result = _areno_train(ray_head, run_dir, tiny_path("qwen3_5"), settings, env)
    assert result.returncode == 0, result.stderr[-6000:]
    return run_dir, root, result.stdout + result.stderr + ray_head.session_logs()


def _steps(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "groups_drawn" in r}


def test_dynamic_sampling_replaces_flat_groups_and_says_when_it_cannot(run):
    run_dir, _, logs = run
    steps = _steps(run_dir)
    assert sorted(steps) == [1, 2, 3]
    for step, (drawn, dropped, rounds, unfilled) in EXPECTED.items():
        record = steps[step]
        assert [int(i.rsplit("-", 1)[1]) for i in record["sample_ids"]] == drawn, step
        assert [int(i.rsplit("-", 1)[1]) for i in record["dropped_sample_ids"]] == dropped
        assert all("-flat-" in i for i in record["dropped_sample_ids"])
        assert record["groups_drawn"] == len(drawn)
        assert record["groups_dropped"] == len(dropped)
        assert record["groups_kept"] == len(drawn) - len(dropped)
        assert record["replacement_rounds"] == rounds
        assert record["dynamic_sampling_unfilled"] == unfilled
        # only the kept groups train: 4 episodes each (one a pass, or packed several a pass)
        trained = record["train_passes"] * record["trajectories_per_pass"]
        assert trained == pytest.approx(4 * record["groups_kept"])
        # the reward metrics are the sampling policy's, over every group drawn
        assert record["episodes"] == 4 * len(drawn)
        assert record["update_skipped"] == 0.0
        # GSPO under the mask: one optimizer step a batch, so the ratio is 1; the mask's
        # fraction is measured (the engine and the trainer agree: nothing is masked)
        assert record["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert record["masked_fraction"] == 0.0
    assert "step 1 kept 1 of 2 groups" in logs and "grpo.max_extra_prompts = 2 reached" in logs
    flat = [r for r in read_metrics(run_dir) if "reward_mean" in r]
    assert all(r["reward_mean"] != FLAT_REWARD for r in flat)  # live groups were drawn too
    assert (run_dir / "tensorboard").is_dir() and any((run_dir / "tensorboard").iterdir())


@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
def test_the_metrics_reach_the_trackers(run, tracker, monkeypatch):
    if tracker not in OPTIONAL:
        pytest.skip(f"{tracker} is not installed (pip install 'areno[{tracker}]')")
    run_dir, root, _ = run
    steps = _steps(run_dir)
    ids = json.loads((run_dir / "trackers.json").read_text())
    if tracker == "mlflow":
        from mlflow.tracking import MlflowClient

        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient((root / "mlruns").as_uri())
        experiment = client.get_experiment_by_name("areno-recipes")
        (found,) = client.search_runs([experiment.experiment_id])
        assert found.info.run_id == ids["mlflow"] and found.info.run_name == "run"
        assert found.info.status == "FINISHED"
        assert found.data.params["grpo.dynamic_sampling"] == "True"
        for key in ("groups_kept", "dynamic_sampling_unfilled", "loss", "reward_mean"):
            history = client.get_metric_history(ids["mlflow"], key)
            assert {m.step: m.value for m in history} == pytest.approx(
                {step: record[key] for step, record in steps.items()}
            ), key
    else:
        (offline,) = (run_dir / "wandb").glob(f"offline-run-*-{ids['wandb']}")
        history = _wandb_history(offline / f"run-{ids['wandb']}.wandb")
        assert sorted(history) == [1, 2, 3]
        for key in ("groups_kept", "dynamic_sampling_unfilled", "loss", "reward_mean"):
            assert {step: row[key] for step, row in history.items()} == pytest.approx(
                {step: record[key] for step, record in steps.items()}
            ), key


def _wandb_history(path: Path) -> dict[int, dict]:
    """The history rows of an offline W&B run file, by step: a LevelDB-style log (a 7-byte
    header, 32 KiB blocks of chunks, each a 7-byte header: crc, length, kind 1 full / 2 first /
    3 middle / 4 last) of wandb's `Record` protobufs, which wandb itself reads back only when
    syncing."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    pos, chunks, records = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # a block's padding
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(chunks)
            chunks = b""
    rows = {}
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            rows.setdefault(record.history.step.num, {}).update(row)
    return rows


def test_a_tracker_without_its_package_is_refused_before_ray_starts(tmp_path, monkeypatch, capsys):
    import ray

    from areno.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # what an import finds when it is missing
    run_dir = tmp_path / "run"
    assert main(["train", "--run-dir", str(run_dir), "--set", "run.loggers=[wandb]"]) == 2
    error = capsys.readouterr().err
    assert "run.loggers names wandb" in error and "pip install 'areno[wandb]'" in error
    assert not ray.is_initialized()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if "mlflow" in OPTIONAL:
        assert main(["train", "--run-dir", str(run_dir), "--set", "run.loggers=[mlflow]"]) == 2
        assert "set MLFLOW_TRACKING_URI" in capsys.readouterr().err
