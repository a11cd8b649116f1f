"""Samples that cannot run (`areno train` on a Ray head, like test_grpo_run.py): a sample whose
image is missing or whose prompt is over `rollout.max_prompt_tokens` is skipped, named in the
log with the error, counted in `metrics.jsonl`, and the run goes on; a run where every sample of
a batch is skipped fails, saying so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from areno.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "color_quiz.yaml"
RUN_LIMIT_S = 600


def _train(ray_head, model: Path, run_dir: Path, media: Path, settings: dict, steps: int):
    """`areno train` of the broken color quiz for `steps` steps of 4 prompts x 2 samples."""
    loader_kwargs = {"num_samples": 8, "media_dir": str(media), **settings.pop("loader", {})}
    settings = {
        "data.loader": "tests.train.bad_samples_task:load",
        "data.loader_kwargs": loader_kwargs,
        "data.eval_loader_kwargs": {**loader_kwargs, "split": "validation"},
        "rollout.max_prompt_tokens": 160,
        "run.export_hf": False,
        **settings,
    }
    args = [
        *("--config", str(CONFIG), "--model-path", str(model), "--run-dir", str(run_dir)),
        *("--max-steps", str(steps), "--group-size", "2", "--prompts-per-step", "4"),
    ]
    for key, value in settings.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    # cwd=REPO: Ray puts the driver's working directory on its workers' path, so they import
    # tests.train.bad_samples_task.
    return ray_head.run(
        sys.executable, "-m", "areno.cli", "train", "--no-progress", *args,
        cwd=REPO, timeout=RUN_LIMIT_S,
    )  # fmt: skip


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("media")


def test_a_bad_sample_is_skipped_named_and_counted(ray_head, tiny_path, media, tmp_path):
    run_dir = tmp_path / "run"
    settings = {"loader": {"missing": [1], "long": [2]}, "run.eval_every": 1, "run.eval_size": 4}
    result = _train(ray_head, tiny_path("qwen3_5"), run_dir, media, settings, steps=2)
    assert result.returncode == 0, result.stderr[-4000:]
    logs = result.stdout + result.stderr + ray_head.session_logs()
    records = read_metrics(run_dir)
    steps = {r["step"]: r for r in records if "sample_ids" in r}
    # samples 1 and 2 of the stream are in step 1's batch of 4 (the quiz loads unshuffled)
    assert steps[1]["skipped_samples"] == 2 and steps[1]["episodes"] == 2 * 2
    assert steps[2]["skipped_samples"] == 0 and steps[2]["episodes"] == 4 * 2
    assert steps[1]["sample_ids"][1:3] == ["color_quiz-train-1", "color_quiz-train-2"]
    assert "sample 'color_quiz-train-1' skipped in step 1's rollout: MediaNotFoundError" in logs
    assert ".png.gone.png" in logs
    assert "sample 'color_quiz-train-2' skipped in step 1's rollout: PromptTooLongError" in logs
    assert "--max-prompt-tokens=160" in logs
    # the held-out set has the same two broken samples, skipped at every evaluation
    evals = [r for r in records if "eval/skipped_samples" in r]
    assert len(evals) >= 2 and all(r["eval/skipped_samples"] == 2 for r in evals)
    assert all(r["eval/episodes"] == 2 for r in evals)  # 2 of 4 held-out samples, 1 draw each


def test_a_batch_with_no_sample_that_runs_fails_the_run_saying_so(
    ray_head, tiny_path, media, tmp_path
):
    settings = {"rollout.max_prompt_tokens": 8}
    result = _train(ray_head, tiny_path("qwen3_5"), tmp_path / "run", media, settings, steps=1)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "every sample of evaluation was skipped (8)" in output
    assert "PromptTooLongError" in output and "--max-prompt-tokens=8" in output


def test_sft_skips_a_bad_sample_naming_it(tiny_path, media, tmp_path):
    """`areno sft` skips a sample GRPO would skip, naming it, and trains on the rest; with no
    sample left it fails saying so."""
    from areno.errors import ConfigError
    from areno.train.sft import SFTConfig, sft

    lines: list[str] = []
    kwargs = {"num_samples": 4, "media_dir": str(media), "missing": [1]}
    config = SFTConfig(
        model_path=str(tiny_path("qwen3_5")),
        out_dir=str(tmp_path / "warm"),
        loader="tests.train.bad_samples_task:load",
        loader_kwargs=kwargs,
        target_key="warmup_answer",
        steps=1,
        batch_size=2,
        lr=1e-3,
    )
    assert (sft(config, log=lines.append) / "config.json").is_file()
    (skipped,) = [line for line in lines if " skipped: " in line]
    assert skipped.startswith("sft: sample 'color_quiz-train-1' skipped: MediaNotFoundError: ")
    config.loader_kwargs = {**kwargs, "missing": [0, 1, 2, 3]}
    with pytest.raises(ConfigError, match=r"every sample of .* was skipped \(4\)"):
        sft(config, log=lines.append)
