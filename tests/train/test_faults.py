"""Crashes during a GRPO run (`areno train` on a Ray head, like test_grpo_run.py): nothing is
lost and nothing is repeated.

One run of 4 steps (2 prompts x 2 samples each, a checkpoint every step) with two injected
process crashes (tests/train/fault_task.py), each at an exact point:

- step 2: the rollout worker dies at the start of its first group. Ray restarts the actor
  (rollout.max_restarts); the trainer sends the restarted worker the current weights and retries
  the step's rollout with the same samples and seeds.
- step 3: trainer rank 0 dies in the reward, after the rollout. Ray Train restarts the worker
  group: trainer.max_failures is left to its default, which allows restarts because the run
  saves checkpoints (run.save_every); the new group resumes from this launch's step-2
  checkpoint.

A run that saves no checkpoint keeps the default of no restarts: a lost trainer worker ends it,
with an error that says how to go on.

Every step's metrics record lists the sample ids it consumed: over the whole run they must be
exactly the data stream's order, each step once.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from areno.data import SampleStream, load_samples
from areno.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "color_quiz.yaml"
NUM_STEPS, PROMPTS, GROUP = 4, 2, 2
NUM_SAMPLES = 16
ROLLOUT_CRASH_STEP = 2  # its first group: call 2 * (step - 1) + 1 of the worker's agent
TRAINER_CRASH_STEP = 3  # its first reward: call 4 * (step - 1) + 1 of rank 0's reward
RUN_LIMIT_S = 600  # a generous bound that turns a hang into a failure


@pytest.fixture(scope="module")
def faulty_run(ray_head, tiny_path, tmp_path_factory):
    """Runs the crashing training once; returns its run directory and all its log text."""
    root = tmp_path_factory.mktemp("faulty-run")
    run_dir = root / "run"
    rollout_marker, trainer_marker = root / "crash-rollout", root / "crash-trainer"
    rollout_marker.touch()
    trainer_marker.touch()
    settings = {
        "data.loader_kwargs": {"num_samples": NUM_SAMPLES, "media_dir": str(root / "media")},
        "rollout.agent": "tests.train.fault_task:agent",
        "rollout.agent_kwargs": {
            "marker": str(rollout_marker),
            "kill_at_call": PROMPTS * (ROLLOUT_CRASH_STEP - 1) + 1,
        },
        "reward": "tests.train.fault_task:reward",
        "reward_kwargs": {
            "marker": str(trainer_marker),
            "kill_at_call": PROMPTS * GROUP * (TRAINER_CRASH_STEP - 1) + 1,
        },
        "rollout.max_restarts": 1,
        # trainer.max_failures: its default (restarts, since --save-every is set)
        "run.export_hf": False,
        # serial steps, so that the crash lands in a known step's rollout
        "rollout.max_staleness": 0,
    }
    args = [
        *("--config", str(CONFIG), "--model-path", str(tiny_path("qwen3_5"))),
        *("--run-dir", str(run_dir), "--max-steps", str(NUM_STEPS), "--save-every", "1"),
        *("--group-size", str(GROUP), "--prompts-per-step", str(PROMPTS), "--eval-every", "0"),
    ]
    for key, value in settings.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    start = time.monotonic()
    result = _train(ray_head, args)
    print(f"\nthe run with both crashes took {time.monotonic() - start:.1f} s")
    assert result.returncode == 0, result.stderr[-4000:]
    assert not rollout_marker.exists() and not trainer_marker.exists(), "a crash never happened"
    return run_dir, result.stdout + result.stderr + ray_head.session_logs()


def _train(ray_head, args: list[str]):
    # cwd=REPO: Ray puts the driver's working directory on its workers' path, so they import
    # tests.train.fault_task.
    return ray_head.run(
        sys.executable, "-m", "areno.cli", "train", "--no-progress", *args,
        cwd=REPO, timeout=RUN_LIMIT_S,
    )  # fmt: skip


def _step_records(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "sample_ids" in r]


def test_a_lost_rollout_worker_is_replaced_and_its_step_retried(faulty_run):
    run_dir, logs = faulty_run
    records = {r["step"]: r for r in _step_records(run_dir)}
    retried = f"step {ROLLOUT_CRASH_STEP}'s rollout is retried (retry 1 of at most 1)"
    assert retried in logs and "died during the call" in logs
    assert {s: r["rollout_retries"] for s, r in records.items()} == {
        s: int(s == ROLLOUT_CRASH_STEP) for s in range(1, NUM_STEPS + 1)
    }
    retried_step = records[ROLLOUT_CRASH_STEP]
    # The restarted worker sampled on step 1's weights, not the checkpoint it was built from:
    # its policy version is 1 and its logprobs are the trainer's own.
    assert retried_step["policy_version"] == ROLLOUT_CRASH_STEP - 1
    assert retried_step["logprob_mismatch_mean_abs"] <= 1e-4


def test_a_killed_trainer_worker_resumes_without_losing_or_repeating_data(faulty_run, tmp_path):
    run_dir, logs = faulty_run
    assert "restarted after a trainer worker failed" in logs
    assert f"starting at step {TRAINER_CRASH_STEP - 1}" in logs
    records = _step_records(run_dir)
    # one record per step: the crashed step 3 had written none, the resumed run redid it once
    assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
    assert [r["data_position"] for r in records] == [PROMPTS * s for s in range(1, NUM_STEPS + 1)]
    consumed = [sample_id for r in records for sample_id in r["sample_ids"]]
    samples = load_samples(
        "areno.tasks.color_quiz:load",
        split="train",
        num_samples=NUM_SAMPLES,
        media_dir=str(tmp_path / "media"),
    )
    stream = SampleStream(list(samples), seed=0, shuffle=False)
    assert consumed == [s.id for s in stream.next_batch(NUM_STEPS * PROMPTS)]
    saved = json.loads((run_dir / "trainer_state.json").read_text())
    assert (saved["step"], saved["data_position"]) == (NUM_STEPS, NUM_STEPS * PROMPTS)


def test_a_lost_trainer_worker_without_checkpoints_ends_the_run_saying_how_to_resume(
    ray_head, tiny_path, tmp_path
):
    """No run.save_every: nothing to resume from, so no restart by default; the error names the
    setting and the command that go on."""
    marker = tmp_path / "crash-trainer"
    marker.touch()
    reward_kwargs = {"marker": str(marker), "kill_at_call": 1}
    run_dir = tmp_path / "run"
    args = [
        *("--config", str(CONFIG), "--model-path", str(tiny_path("qwen3_5"))),
        *("--run-dir", str(run_dir), "--max-steps", "2", "--eval-every", "0"),
        *("--save-every", "0", "--group-size", str(GROUP), "--prompts-per-step", str(PROMPTS)),
        *("--set", "reward=tests.train.fault_task:reward"),
        *("--set", f"reward_kwargs={json.dumps(reward_kwargs)}"),
        *("--set", "run.export_hf=false"),
    ]
    result = _train(ray_head, args)
    assert not marker.exists(), "the crash never happened"
    assert result.returncode == 2, result.stderr[-4000:]
    error = result.stderr[result.stderr.index("areno: error:") :]
    assert "Training failed due to worker errors" in error  # Ray Train's word comes first
    assert "stopped with no checkpoint to resume from" in error
    assert "--save-every N" in error and f"--resume --run-dir {run_dir}" in error
    assert "Traceback" not in error


def test_a_rollout_worker_that_cannot_start_ends_the_run_with_its_error(
    ray_head, tiny_path, tmp_path
):
    """The trainer starts while the rollout engines do. A worker whose agent raises as it is
    built ends the run at once, with that error: no step, and no restart of the trainer's
    group although checkpoints would allow one (a restart would meet the same worker)."""
    run_dir = tmp_path / "run"
    args = [
        *("--config", str(CONFIG), "--model-path", str(tiny_path("qwen3_5"))),
        *("--run-dir", str(run_dir), "--max-steps", "2", "--eval-every", "0"),
        *("--save-every", "1", "--group-size", str(GROUP), "--prompts-per-step", str(PROMPTS)),
        *("--set", "rollout.agent=tests.train.fault_task:unstartable_agent"),
        *("--set", "run.export_hf=false"),
    ]
    result = _train(ray_head, args)
    assert result.returncode == 2, result.stderr[-4000:]
    error = result.stderr[result.stderr.index("areno: error:") :]
    assert "a rollout worker could not start: RuntimeError: the sandbox this agent needs" in error
    assert "Traceback" not in error
    logs = result.stdout + result.stderr
    assert "a rollout worker could not start; the trainer stops" in logs  # the trainer had begun
    assert "restarted after a trainer worker failed" not in logs
    assert not _step_records(run_dir)


def test_a_misspelled_agent_fails_before_ray_or_an_engine_starts(tiny_path, tmp_path):
    from areno.errors import ConfigError
    from areno.train.config import GRPOConfig
    from areno.train.run import run

    config = GRPOConfig.from_yaml(
        CONFIG,
        {
            "model_path": str(tiny_path("qwen3_5")),
            "run.run_dir": str(tmp_path / "run"),
            "rollout.agent": "tests.train.no_such_task:agent",
        },
    )
    with pytest.raises(ConfigError, match="no module named 'tests.train.no_such_task'"):
        run(config)
