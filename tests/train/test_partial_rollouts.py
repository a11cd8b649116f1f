"""Partial rollouts through `areno train` on a Ray head (`rollout.partial_rollouts`, max_staleness
1): the second step's episodes are running when the first step's weights land and go on under
them. Its trajectories reach the trainer with each token's policy version and the logprob that
policy gave it; the staleness metrics count those versions token by token; the rollout
correction weighs each token by its own behaviour logprob; and a run resumed from the checkpoint
taken while those episodes ran samples them again, from their start, on the resumed policy.

tests/train/partial_task.py records every trajectory the trainer scores. The engine and worker
sides (the drained update, the exact version switch) are tests/rollout/test_weight_landing.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from areno.processing.types import PromptInputs
from areno.train.metrics import read_metrics
from areno.train.policy import sequence_logprobs

REPO = Path(__file__).resolve().parents[2]
RUN_LIMIT_S = 900
TIS_CAP = 1e6  # no token's weight is capped: each is its own proximal / sampler ratio
SETTINGS = {
    "data.loader": "tests.train.partial_task:load",
    "data.loader_kwargs": {"num_samples": 8, "long_words": 220},
    "data.shuffle": False,
    "reward": "tests.train.partial_task:reward",
    # two slots: the second step's episodes start once the first step's end
    "rollout.engine": {"max_running_prompts": 2, "max_context_len": 512},
    "rollout.max_tokens_per_turn": 480,
    "rollout.max_staleness": 1,
    "rollout.partial_rollouts": True,
    "rollout.num_cpus_per_worker": 0.5,
    "trainer.num_cpus_per_worker": 0.5,
    "grpo.behaviour_logprobs": "recompute",
    "grpo.loss": {"rollout_correction": "token_tis", "tis_cap": TIS_CAP},
    "optim.lr": 1e-2,  # one step moves the tiny policy well past the checks' 1e-4
    "run.export_hf": False,
    "run.save_every": 1,
}


def _areno_train(ray_head, run_dir: Path, model: Path, record: Path, *extra: str):
    args = [
        *("--model-path", str(model), "--run-dir", str(run_dir), "--max-steps", "2"),
        *("--group-size", "2", "--prompts-per-step", "1", "--eval-every", "0"),
    ]
    settings = {**SETTINGS, "reward_kwargs": {"record": str(record)}}
    for key, value in settings.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    # cwd=REPO: Ray puts the driver's working directory on its workers' path (the task module)
    result = subprocess.run(
        [sys.executable, "-m", "areno.cli", "train", "--no-progress", *args, *extra],
        cwd=REPO, env=ray_head.env, capture_output=True, text=True, timeout=RUN_LIMIT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-6000:]


def _trajectories(record: Path) -> dict[str, list[dict]]:
    """The recorded trajectories by sample id (one sample a step, unshuffled)."""
    by_sample: dict[str, list[dict]] = {}
    for line in record.read_text().splitlines():
        traj = json.loads(line)
        by_sample.setdefault(traj["sample_id"], []).append(traj)
    return by_sample


def _steps(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "staleness_max" in r}


@pytest.fixture(scope="module")
def runs(ray_head, tiny_path, tmp_path_factory):
    """A two-step run, then the same run resumed from its first step's checkpoint (taken while
    the second step's episodes were in flight), as if it had been stopped there."""
    root = tmp_path_factory.mktemp("partial")
    model, run_dir = tiny_path("qwen3_5"), root / "run"
    _areno_train(ray_head, run_dir, model, root / "first.jsonl")
    first = SimpleNamespace(steps=_steps(run_dir), trajectories=_trajectories(root / "first.jsonl"))
    policy_1 = _policy_at(run_dir, "step_1", model)
    (run_dir / "checkpoints" / "latest").write_text("step_1")
    _areno_train(ray_head, run_dir, model, root / "resumed.jsonl", "--resume")
    resumed = SimpleNamespace(
        steps=_steps(run_dir),
        trajectories=_trajectories(root / "resumed.jsonl"),
        records=read_metrics(run_dir),
    )
    return SimpleNamespace(model=model, policy_1=policy_1, first=first, resumed=resumed)


def _policy_at(run_dir: Path, tag: str, model: Path) -> torch.nn.Module:
    """The policy a checkpoint holds (ZeRO-0: whole parameters): the weights pushed to the
    workers as that step's version."""
    from areno.processing.processor import Processor

    policy = Processor(model).adapter.load_model(model).eval()
    saved = torch.load(
        run_dir / "checkpoints" / tag / "mp_rank_00_model_states.pt",
        map_location="cpu",
        weights_only=False,
    )["module"]
    _, unexpected = policy.load_state_dict(saved, strict=False)
    assert not unexpected and saved, (unexpected, len(saved))
    return policy


def _sampled_logprobs(traj: dict, policy: torch.nn.Module) -> list[float]:
    inputs = PromptInputs(traj["token_ids"], {})
    with torch.no_grad():
        return sequence_logprobs(policy, inputs, "cpu", traj["num_prompt_tokens"]).tolist()


def test_an_episode_spans_two_policies_and_each_token_keeps_its_own(runs):
    """The second step's episodes began under policy 0 and ended under policy 1: their tokens
    carry both versions, in order, and each token's behaviour logprob is the one its own
    policy gave it (policy 1's tokens scored with the weights of the step-1 checkpoint)."""
    from areno.processing.processor import Processor

    policy_0 = Processor(runs.model).adapter.load_model(runs.model).eval()
    policies = {0: policy_0, 1: runs.policy_1}
    second = runs.first.trajectories["train-1"]
    assert len(second) == 2
    spanning = [t for t in second if set(t["token_versions"]) == {0, 1}]
    assert spanning, [t["token_versions"][:1] + t["token_versions"][-1:] for t in second]
    for traj in second:
        n, versions = traj["num_prompt_tokens"], traj["token_versions"]
        assert versions == sorted(versions)  # weights only ever move forward
        assert traj["loss_mask"][n:] == [1] * len(versions)  # one turn: every token sampled
        sampled = traj["rollout_logprobs"][n:]
        expected = {v: _sampled_logprobs(traj, p) for v, p in policies.items()}
        for i, version in enumerate(versions):
            assert sampled[i] == pytest.approx(expected[version][i], abs=1e-4), (i, version)
    for traj in spanning:
        # the policies disagree on the tokens after the switch: the check tells them apart
        switch = traj["token_versions"].index(1)
        old, new = (_sampled_logprobs(traj, policies[v])[switch:] for v in (0, 1))
        assert max(abs(a - b) for a, b in zip(old, new, strict=True)) > 1e-2


def test_the_staleness_metrics_count_each_tokens_own_version(runs):
    steps, trajectories = runs.first.steps, runs.first.trajectories
    for step, sample in ((1, "train-0"), (2, "train-1")):
        versions = [v for t in trajectories[sample] for v in t["token_versions"]]
        ages = {age: versions.count(step - 1 - age) for age in (0, 1)}
        expected = {f"staleness/{k}": float(n) for k, n in ages.items() if n}
        assert {k: v for k, v in steps[step].items() if k.startswith("staleness/")} == expected
        spanning = sum(len(set(t["token_versions"])) > 1 for t in trajectories[sample])
        assert steps[step]["partial_episodes"] == spanning
    assert steps[1]["staleness_max"] == 0.0 and steps[2]["staleness_max"] == 1.0
    assert steps[2]["partial_episodes"] >= 1


def test_the_correction_weighs_each_token_by_its_own_behaviour_logprob(runs):
    """token_tis at step 2: the proximal policy is policy 1 (one optimizer step a batch: the
    ratio is 1); each token's weight is policy 1's probability over the one that sampled it:
    about 1 on policy 1's tokens, another number on policy 0's; the step's mean is theirs."""
    step = runs.first.steps[2]
    weights = []
    for traj in runs.first.trajectories["train-1"]:
        n = traj["num_prompt_tokens"]
        proximal = _sampled_logprobs(traj, runs.policy_1)
        weights += [
            math.exp(p - s) for p, s in zip(proximal, traj["rollout_logprobs"][n:], strict=True)
        ]
    assert step["tis_weight_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-3)
    assert step["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert step["tis_capped_fraction"] == 0.0
    # the engine and the trainer agree on the tokens policy 1 sampled, those after the
    # switch included (the engine prefilled the running episodes again under policy 1)
    assert step["logprob_mismatch_max_abs"] <= 1e-4


def test_a_resumed_run_samples_the_episodes_in_flight_at_its_checkpoint_again(runs):
    """The checkpoint of step 1 saves no episode: its data position is the step trained, so
    the resumed run draws the second step's sample again and runs its episodes from their
    start on policy 1, the one it resumed with; metrics.jsonl keeps one record a step."""
    first, resumed = runs.first.steps, runs.resumed.steps
    assert resumed[2]["sample_ids"] == first[2]["sample_ids"] == ["train-1"]
    assert resumed[1] == first[1]  # kept from the first run
    (again,) = [t for s, t in runs.resumed.trajectories.items()]
    assert len(again) == 2 and all(set(t["token_versions"]) == {1} for t in again)
    assert resumed[2]["staleness_max"] == 0.0 and resumed[2]["partial_episodes"] == 0.0
    assert [r["step"] for r in runs.resumed.records if "staleness_max" in r] == [1, 2]
