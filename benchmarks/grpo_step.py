"""Seconds per GRPO step, and where they go, for the color quiz and the AVE agent at their
shipped configs (configs/color_quiz.yaml, examples/multimodal/ave_event_recognition/grpo.yaml)
on the embedded tiny checkpoints: the serial loop with one trajectory per trainer pass
(`rollout.max_staleness 0`, `trainer.micro_batch_tokens 0`) beside the configs as shipped
(overlapped, `max_staleness 1`; batched passes, `micro_batch_tokens` 4096: the AVE groups'
episodes packed a group a row, their prompt once), in one run; `--also` adds settings.

The color quiz starts from its format-only warm start (`areno sft --target-key warmup_answer`,
as its README section runs it), so its groups have rewards to learn from. The AVE agent starts
from the embedded tiny Gemma 4; its own reward is 0 for every episode of that untrained policy,
so no step would train: the AVE runs score episodes with `varied_reward` below instead, a
stand-in whose rewards differ within a group, so every step trains as a warm-started run's does.

Each setting is `areno train` in a subprocess, as a user runs it (its own local Ray), for
`--steps` steps without evaluation; the figures are means over the steps after the first
(the first pays for start-up and, overlapped, has no earlier rollout to hide behind).
Per step, from metrics.jsonl: `step_s` (wall), `rollout_s` (the step's rollout on the workers,
overlapped with other phases when max_staleness > 0), `idle_s` (the trainer waiting for that
rollout), `train_s`, `weight_sync_s`.

    python benchmarks/grpo_step.py                 # both tasks, 6 steps each setting
    python benchmarks/grpo_step.py --tasks ave --steps 8
    python benchmarks/grpo_step.py --tasks ave --also rollout.max_staleness=0  # more settings
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))
from engine_workloads import write_results  # noqa: E402

from areno.models.tiny import tiny_checkpoint  # noqa: E402

# "shipped": the task's config as it is (both ship max_staleness 1; the color quiz batched passes)
SETTINGS = {
    "serial, 1 per pass": {"rollout.max_staleness": 0, "trainer.micro_batch_tokens": 0},
    "shipped": {},
}
PHASES = ("step_s", "rollout_s", "idle_s", "train_s", "weight_sync_s", "reward_s")
AVE = "examples/multimodal/ave_event_recognition"


def varied_reward(trajectory, private: dict, **_) -> float:
    """The AVE runs' stand-in reward (see the module docstring): in [0, 1], from the text."""
    return (len(trajectory.final_text) % 5) / 4


def warm_start(data: Path) -> Path:
    """The color quiz's format-only warm start (its README section's `areno sft` command)."""
    from areno.train.sft import SFTConfig, sft

    out = data / "color_quiz_warm"
    if not (out / "config.json").exists():
        config = SFTConfig(
            model_path=str(tiny_checkpoint("qwen3_5")),
            out_dir=str(out),
            loader="areno.tasks.color_quiz:load",
            loader_kwargs={"num_samples": 256, "media_dir": str(data / "color_quiz")},
            target_key="warmup_answer",
            steps=60,
            lr=3e-3,
        )
        sft(config, log=lambda _: None)
    return out


def task_args(task: str, data: Path) -> list[str]:
    if task == "color_quiz":
        return [
            "--config",
            str(REPO / "configs" / "color_quiz.yaml"),
            "--model-path",
            str(warm_start(data)),
            "--set",
            f"data.loader_kwargs.media_dir={data / 'color_quiz'}",
        ]
    if not (data / "ave" / "train.jsonl").exists():
        subprocess.run(
            [sys.executable, f"{AVE}/generate_dataset.py", "--out", str(data / "ave")]
            + ["--num-train", "48", "--num-validation", "8", "--no-progress"],
            cwd=REPO,
            check=True,
        )
    path = str(data / "ave")
    return [
        "--config",
        str(REPO / AVE / "grpo.yaml"),
        "--set",
        f"data.loader_kwargs.path={path}",
        "--set",
        f"data.eval_loader_kwargs.path={path}",
        "--set",
        "reward=benchmarks.grpo_step:varied_reward",
    ]


def run(task: str, name: str, setting: dict, steps: int, data: Path, work: Path) -> dict:
    run_dir = work / f"{task}-{''.join(c if c.isalnum() else '_' for c in name)}"
    cmd = [sys.executable, "-m", "areno.cli", "train", "--no-progress", *task_args(task, data)]
    cmd += ["--run-dir", str(run_dir), "--max-steps", str(steps), "--eval-every", "0"]
    cmd += ["--set", "run.export_hf=false", "--set", "run.save_every=0"]
    for key, value in setting.items():
        cmd += ["--set", f"{key}={value}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray per run
    env.update(PYTHONPATH=str(REPO), RAY_AUTH_MODE=env.get("RAY_AUTH_MODE", "disabled"))
    start = time.perf_counter()
    log = work / f"{run_dir.name}.log"
    with log.open("w") as out:
        result = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{task} failed; see {log}:\n" + log.read_text()[-3000:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if "step_s" in r and r["step"] > 1]
    row = {k: sum(r.get(k, 0.0) for r in steady) / len(steady) for k in PHASES}
    row["train_passes"] = sum(r["train_passes"] for r in steady) / len(steady)
    row["trajectories_per_pass"] = max(r["trajectories_per_pass"] for r in steady)
    row["padding_fraction"] = max(r["padding_fraction"] for r in steady)
    row["shared_fraction"] = sum(r.get("shared_fraction", 0.0) for r in steady) / len(steady)
    row["staleness_max"] = max(r["staleness_max"] for r in steady)
    row["reward_mean"] = sum(r["reward_mean"] for r in steady) / len(steady)
    row["run_wall_s"] = wall
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="color_quiz,ave")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="one more setting beside the two, as `areno train --set` overrides (repeatable)",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/grpo_step.json"))
    args = parser.parse_args()
    settings = dict(SETTINGS)
    for also in args.also:
        pairs = [pair.split("=", 1) for pair in also.split(",")]
        if any(len(pair) != 2 or not pair[0] for pair in pairs):
            parser.error(f"--also {also!r}: expected KEY=VALUE[,KEY=VALUE]")
        settings[also] = dict(pairs)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="grpo_step_") as tmp:
        data, work = Path(tmp) / "data", Path(tmp) / "runs"
        work.mkdir(parents=True)
        for task in args.tasks.split(","):
            results[task] = {}
            for name, setting in settings.items():
                row = run(task, name, setting, args.steps, data, work)
                results[task][name] = {**setting, **row}
                print(task, name, json.dumps(results[task][name]), flush=True)
    width = max(20, *(len(name) for name in settings))
    header = f"{'task':<11} {'setting':<{width}} " + " ".join(f"{p:>13}" for p in PHASES)
    print(header + f" {'passes':>7} {'speed-up':>9}")
    for task, rows in results.items():
        base = rows["serial, 1 per pass"]["step_s"]
        for name, row in rows.items():
            cells = " ".join(f"{row[p]:>13.2f}" for p in PHASES)
            print(
                f"{task:<11} {name:<{width}} {cells} {row['train_passes']:>7.1f} "
                f"{base / row['step_s']:>8.2f}x"
            )
    meta = {"steps": args.steps, "settings": settings, "mean_over": "steps 2..N"}
    write_results(args.out, meta, {"results": results})


if __name__ == "__main__":
    main()
