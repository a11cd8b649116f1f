"""GRPO on an agent program (`rollout.program`), end to end: `areno train` on a Ray head runs
tests/programs/quiz_program.py, written with the official `openai` client (a tool call round
trip, a chat loop, then a rewritten history), two steps on the tiny Gemma 4 with the color quiz
and a canary in every sample's private metadata.

Checked from what the program saw (the API's `token_ids` / `prompt_token_ids`) and what the
reward saw (the trajectory, every recorded call, the private metadata):
- every recorded call is the ids the API reported to the program (recorded on the server side);
- an episode's trajectories are its runs of calls whose prompt extends the previous call's
  prompt and reply: the first one's tokens are its last call's prompt and reply, its loss mask
  1 exactly on each call's sampled tokens; the rewritten call always starts another part;
- the reward reads private metadata; the program never does (not in its sample, not sent);
- the evaluations (steps 0 and 2) run the same program on the held-out samples.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from areno.train.metrics import read_metrics
from tests.train.canary_task import CANARY

REPO = Path(__file__).resolve().parents[2]
NUM_STEPS, PROMPTS, GROUP = 2, 2, 2
EVAL_SIZE = 2  # held-out samples, evaluated at steps 0 and NUM_STEPS
RUN_LIMIT_S = 900  # a generous bound that turns a hang into a failure


@pytest.fixture(scope="module")
def program_run(ray_head, tiny_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("program-run")
    media = root / "media"
    settings = {
        "data.loader": "tests.train.canary_task:load",
        "data.loader_kwargs": {"num_samples": 8, "media_dir": str(media)},
        "reward": "tests.programs.quiz_program:reward",
        "reward_kwargs": {"log": str(root / "reward-log.jsonl")},
        "rollout.program": "tests.programs.quiz_program:run",
        "rollout.engine": {"max_running_prompts": 8, "max_context_len": 1024},
        "rollout.num_cpus_per_worker": 0.5,
        "trainer.num_cpus_per_worker": 0.5,
        "run.export_hf": False,
    }
    args = [
        *("--model-path", str(tiny_path("gemma4")), "--run-dir", str(root / "run")),
        *("--max-steps", str(NUM_STEPS), "--eval-every", str(NUM_STEPS)),
        *("--set", f"run.eval_size={EVAL_SIZE}"),
        *("--group-size", str(GROUP), "--prompts-per-step", str(PROMPTS)),
    ]
    for key, value in settings.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    # cwd=REPO: Ray puts the driver's working directory on its workers' path (tests.programs)
    result = ray_head.run(
        sys.executable, "-m", "areno.cli", "train", "--no-progress", *args,
        cwd=REPO, timeout=RUN_LIMIT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    program = [json.loads(line) for line in (media / "program-log.jsonl").open()]
    rewards = [json.loads(line) for line in (root / "reward-log.jsonl").open()]
    return read_metrics(root / "run"), program, rewards


@pytest.fixture(scope="module")
def trained(program_run):
    """The training episodes' lines (the evaluations' held-out samples left out)."""
    metrics, program, rewards = program_run
    program = [p for p in program if not _held_out(p["sample"]["id"])]
    return metrics, program, [r for r in rewards if not _held_out(r["sample_id"])]


def _held_out(sample_id: str) -> bool:
    return "-validation-" in sample_id


def _chains(calls: list[dict]) -> list[list[int]]:
    """The test's own prefix rule: runs of calls each extending the one before."""
    runs: list[list[int]] = []
    for i, call in enumerate(calls):
        if runs:
            before = calls[runs[-1][-1]]
            seen = before["prompt_ids"] + before["token_ids"]
            if call["prompt_ids"][: len(seen)] == seen:
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs


def test_every_episode_is_trained_from_the_ids_the_engine_ran(trained):
    metrics, program, rewards = trained
    assert len(program) == len(rewards) == NUM_STEPS * PROMPTS * GROUP
    # every call the reward sees is one the program made, with the ids the API reported
    reported = sorted(json.dumps(p["calls"]) for p in program)
    recorded = sorted(
        json.dumps([{k: c[k] for k in ("prompt_token_ids", "token_ids")} for c in calls])
        for calls in (
            [{"prompt_token_ids": c["prompt_ids"], "token_ids": c["token_ids"]} for c in r["calls"]]
            for r in rewards
        )
    )  # fmt: skip
    assert reported == recorded
    assert all(p["tool_calls"] >= 1 for p in program)  # the tool round trip happened
    multi_turn = 0
    for r in rewards:
        runs = _chains(r["calls"])
        assert r["part"] == 0 and r["num_parts"] == len(runs) >= 2  # call 4 rewrote history
        assert runs[-1] == [3]
        first = [r["calls"][i] for i in runs[0]]
        assert r["token_ids"] == first[-1]["prompt_ids"] + first[-1]["token_ids"]
        sampled = [t for t, m in zip(r["token_ids"], r["loss_mask"], strict=True) if m]
        assert sampled == [t for c in first for t in c["token_ids"]]
        multi_turn += sum(len(run) > 1 for run in runs)
        assert r["final_text"] == r["output"]
    assert multi_turn > 0  # some call extended the one before: one multi-turn trajectory
    steps = [m for m in metrics if "program_split_episodes" in m]
    assert len(steps) == NUM_STEPS
    assert sum(m["program_split_episodes"] for m in steps) == len(rewards)
    assert sum(m["program_transitions"] for m in steps) == sum(r["num_parts"] for r in rewards)
    assert all(m["program_calls_per_episode"] == 4.0 for m in steps)


def test_evaluation_runs_the_program_on_the_held_out_samples(program_run):
    """`areno train`'s evaluation is the same program on the held-out samples (greedy), each
    episode scored by the reward; its metrics are the program's."""
    metrics, program, rewards = program_run
    evals = [m for m in metrics if "eval/program_calls_per_episode" in m]
    assert [m["step"] for m in evals] == [0, NUM_STEPS]
    assert all(m["eval/program_calls_per_episode"] == 4.0 for m in evals)
    assert all(m["eval/episodes"] == EVAL_SIZE for m in evals)
    held_out = [p["sample"]["id"] for p in program if _held_out(p["sample"]["id"])]
    assert len(held_out) == len(evals) * EVAL_SIZE
    assert sorted(held_out) == sorted(r["sample_id"] for r in rewards if _held_out(r["sample_id"]))


def test_private_metadata_reaches_the_reward_and_never_the_program(program_run):
    _, program, rewards = program_run
    assert all(r["private_canary"] for r in rewards)
    assert all(set(p["sample"]) == {"id", "messages", "tools"} for p in program)
    assert CANARY not in json.dumps(program)
    assert CANARY not in json.dumps([c["messages"] for r in rewards for c in r["calls"]])
