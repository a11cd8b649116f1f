"""Seconds per GRPO step, and where they go, for the color quiz and the AVE agent at their
shipped configs (configs/color_quiz.yaml, examples/multimodal/ave_event_recognition/grpo.yaml)
on the embedded tiny checkpoints, beside other settings of the same run, in one run. The
settings (`--settings`, the first the baseline of the speed-up column):
- `serial`: the serial loop with one trajectory per trainer pass (`rollout.max_staleness 0`,
  `trainer.micro_batch_tokens 0`);
- `shipped`: the config as shipped (overlapped, `max_staleness 1`; batched passes,
  `micro_batch_tokens` 4096: the AVE groups' episodes packed a group a row, their prompt once);
- `drained` / `partial`: `max_staleness 1` with a weight update that waits for the episodes in
  flight to end, or one that lands at once and re-prefills them (`rollout.partial_rollouts`).
`--also` adds settings as `--set` overrides, `--tree NAME=PATH` runs each setting with the code
of another checkout too (before/after a change, in one run), `--set` changes the workload of
every setting (the AVE episodes' length, say); `--repeats N` runs the settings in turns N times, the order reversed
every other time (A B B A ...), so that the load of other jobs on a shared machine falls on
each alike.

The color quiz starts from its format-only warm start (`areno sft --target-key warmup_answer`,
as its README section runs it), so its groups have rewards to learn from. The AVE agent starts
from the embedded tiny Gemma 4; its own reward is 0 for every episode of that untrained policy,
so no step would train: the AVE runs score episodes with `varied_reward` below instead, a
stand-in whose rewards differ within a group, so every step trains as a warm-started run's does.

Each setting is `areno train` in a subprocess, as a user runs it (its own local Ray), for
`--steps` steps without evaluation; the figures are means over the steps after the first
(the first pays for start-up and, overlapped, has no earlier rollout to hide behind), and over
the repeats; the first step's wall time is reported beside them (`first_step_s`, with its
rollout's `first_rollout_s`). Per step, from metrics.jsonl: `step_s` (wall), `rollout_s` (the
step's rollout on the workers, overlapped with other phases when max_staleness > 0), `idle_s`
(the trainer waiting for that rollout), `train_s`, `weight_sync_s` (drained: with the wait for
the episodes in flight), and the prompt tokens the rollout engines computed
(`prefill_tokens_computed`).

    python benchmarks/grpo_step.py                 # both tasks, serial and shipped, 6 steps
    python benchmarks/grpo_step.py --tasks ave --settings drained,partial --steps 8 --repeats 2
    python benchmarks/grpo_step.py --tasks ave --settings drained,partial \
        --set rollout.max_tokens_per_turn=192     # longer episodes: the rollout bounds the step
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
from engine_workloads import stop_on_terminate, write_results  # noqa: E402

from areno.models.tiny import tiny_checkpoint  # noqa: E402

SETTINGS = {
    "serial": {"rollout.max_staleness": 0, "trainer.micro_batch_tokens": 0},
    "shipped": {},
    "drained": {"rollout.max_staleness": 1, "rollout.partial_rollouts": False},
    "partial": {"rollout.max_staleness": 1, "rollout.partial_rollouts": True},
}
PHASES = ("step_s", "rollout_s", "idle_s", "train_s", "weight_sync_s", "reward_s")
# The timeline of a step on rank 0 (`time/*` metrics, in the order they run): from the end of
# the step before (`time/cycle_s`, which holds the step before's record and checkpoint) to the
# end of this one; what no phase covers is "unattributed".
TIMELINE = (
    ("record (step before)", "time/record_s"),
    ("checkpoint (step before)", "time/checkpoint_s"),
    ("evaluation", "time/eval_s"),
    ("launch next rollouts", "time/launch_s"),
    ("wait for rollout", "time/rollout_wait_s"),
    ("reward", "time/reward_s"),
    ("dynamic-sampling refill", "time/refill_s"),
    ("advantages, metrics", "time/advantages_s"),
    ("packing", "time/packing_s"),
    ("scatter to ranks", "time/scatter_s"),
    ("forward", "time/forward_s"),
    ("backward", "time/backward_s"),
    ("optimizer", "time/optimizer_s"),
    ("train: loss, sums", None),  # time/train_s less forward, backward, optimizer
    ("weight sync", "time/weight_sync_s"),
    ("broadcast state", "time/broadcast_s"),
)
TRAIN_PARTS = ("time/forward_s", "time/backward_s", "time/optimizer_s")
# The rollout workers' side: seconds of work per phase (summed over a step's concurrent
# groups and episodes), and the engine's between two gathers.
WORKER_TIMELINE = (
    ("media decoding", "time/rollout/media_s"),
    ("processing", "time/rollout/process_s"),
    ("tower encoding (engine)", "time/rollout/media_encode_s"),
    ("prefill steps (engine)", "time/rollout/prefill_s"),
    ("decode steps (engine)", "time/rollout/decode_s"),
    ("engine wait, per episode", "time/rollout/generate_s"),  # divided by the episodes
    ("tools", "time/rollout/tools_s"),
    ("tool results into the prompt", "time/rollout/tool_inputs_s"),
)
# means over the steps, beside the phases
MEANS = ("train_passes", "shared_fraction", "prefill_tokens_computed", "partial_episodes")
MAXIMA = ("trajectories_per_pass", "padding_fraction", "staleness_max")  # maxima over the steps
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


def task_args(task: str, data: Path, tree: Path = REPO) -> list[str]:
    if task == "color_quiz":
        return [
            "--config",
            str(tree / "configs" / "color_quiz.yaml"),
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
        str(tree / AVE / "grpo.yaml"),
        "--set",
        f"data.loader_kwargs.path={path}",
        "--set",
        f"data.eval_loader_kwargs.path={path}",
        "--set",
        "reward=benchmarks.grpo_step:varied_reward",
    ]


def run(
    task: str, name: str, setting: dict, steps: int, data: Path, work: Path, tree: Path = REPO
) -> dict:
    """One `areno train` run of `setting`, with the code of the checkout `tree`."""
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / f"{task}-{''.join(c if c.isalnum() else '_' for c in name)}"
    cmd = [sys.executable, "-m", "areno.cli", "train", "--no-progress"]
    cmd += task_args(task, data, tree)
    cmd += ["--run-dir", str(run_dir), "--max-steps", str(steps), "--eval-every", "0"]
    cmd += ["--set", "run.export_hf=false", "--set", "run.save_every=0"]
    for key, value in setting.items():
        cmd += ["--set", f"{key}={value}"]
    # A new local Ray per run, even where another job's `ray start` cluster runs on the machine
    # (`ray.init` would join it, or hang on it once it is gone).
    env = {**os.environ, "RAY_ADDRESS": "local"}
    # the tree's code first, then whatever the caller's path holds (an offline bundle's packages)
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    env.update(PYTHONPATH=path, RAY_AUTH_MODE=env.get("RAY_AUTH_MODE", "disabled"))
    start = time.perf_counter()
    log = work / f"{run_dir.name}.log"
    with log.open("w") as out:
        result = subprocess.run(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{task} failed; see {log}:\n" + log.read_text()[-3000:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if "step_s" in r and r["step"] > 1]
    row = {k: sum(r.get(k, 0.0) for r in steady) / len(steady) for k in PHASES + MEANS}
    row.update({k: max(r[k] for r in steady) for k in MAXIMA})
    row["reward_mean"] = sum(r["reward_mean"] for r in steady) / len(steady)
    first = next(r for r in records if "step_s" in r and r["step"] == 1)
    row.update(first_step_s=first["step_s"], first_rollout_s=first["rollout_s"])
    row["run_wall_s"] = wall
    row["per_step"] = [{k: r.get(k, 0.0) for k in PHASES} for r in steady]
    row["timeline"] = timeline(steady)
    return row


def timeline(records: list[dict]) -> dict[str, float]:
    """Mean seconds a step per `TIMELINE` and `WORKER_TIMELINE` phase, the cycle
    (`time/cycle_s`: end of the step before to the end of this one) and what no rank-0 phase
    covers of it; empty where the run's metrics have no `time/*` keys (an older tree)."""
    timed = [r for r in records if "time/cycle_s" in r]
    if not timed:
        return {}

    def mean(get) -> float:
        return sum(get(r) for r in timed) / len(timed)

    out = {}
    for label, key in TIMELINE:
        if key is None:
            out[label] = mean(lambda r: r["time/train_s"] - sum(r.get(p, 0.0) for p in TRAIN_PARTS))
        else:
            out[label] = mean(lambda r, key=key: r.get(key, 0.0))
    out["cycle"] = mean(lambda r: r["time/cycle_s"])
    out["unattributed"] = out["cycle"] - sum(out[label] for label, _ in TIMELINE)
    out["rollout (wall, on the workers)"] = mean(lambda r: r["rollout_s"])
    for label, key in WORKER_TIMELINE:
        per = "per episode" in label
        out[label] = mean(
            lambda r, key=key, per=per: r.get(key, 0.0) / (r["episodes"] if per else 1)
        )
    return out


def overrides(text: str, flag: str, parser: argparse.ArgumentParser) -> dict:
    """`KEY=VALUE[,KEY=VALUE]` as a dict of `areno train --set` overrides."""
    pairs = [pair.split("=", 1) for pair in text.split(",")]
    if any(len(pair) != 2 or not pair[0] for pair in pairs):
        parser.error(f"{flag} {text!r}: expected KEY=VALUE[,KEY=VALUE]")
    return dict(pairs)


def parse_settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The settings to run, by name (`SETTINGS`) then `--also` overrides, in order, each with
    the `--set` overrides of the workload."""
    settings = {}
    for name in args.settings.split(","):
        if name not in SETTINGS:
            parser.error(f"--settings {name!r}: expected one of {', '.join(SETTINGS)}")
        settings[name] = SETTINGS[name]
    for extra in args.also:
        settings[extra] = overrides(extra, "--also", parser)
    workload = {k: v for text in args.set for k, v in overrides(text, "--set", parser).items()}
    return {name: {**setting, **workload} for name, setting in settings.items()}


def parse_trees(
    args: argparse.Namespace, parser: argparse.ArgumentParser, settings: dict
) -> tuple[dict, dict[str, Path]]:
    """With `--tree NAME=PATH`: every setting once a checkout, named `SETTING@NAME`, and the
    checkout of each (else this one's)."""
    if not args.tree:
        return settings, dict.fromkeys(settings, REPO)
    trees = overrides(",".join(args.tree), "--tree", parser)
    for name, path in trees.items():
        if not (Path(path) / "areno" / "cli.py").is_file():
            parser.error(f"--tree {name}={path}: not an AReno checkout (no areno/cli.py there)")
    named = {f"{s}@{t}": setting for s, setting in settings.items() for t in trees}
    return named, {f"{s}@{t}": Path(p).resolve() for s in settings for t, p in trees.items()}


def in_turns(settings: dict, repeats: int) -> list[str]:
    """Each setting once a repeat, the order reversed every other repeat (A B B A ...)."""
    names = list(settings)
    return [name for r in range(repeats) for name in (names if r % 2 == 0 else names[::-1])]


def mean_row(rows: list[dict]) -> dict:
    """The repeats' rows as one: numbers averaged (maxima where the row keeps a maximum)."""
    merged = {}
    for key in [key for key in rows[0] if key not in ("per_step", "timeline")]:
        values = [row[key] for row in rows]
        merged[key] = max(values) if key in MAXIMA else sum(values) / len(values)
    lines = [row["timeline"] for row in rows if row["timeline"]]
    merged["timeline"] = (
        {k: sum(line[k] for line in lines) / len(lines) for k in lines[0]} if lines else {}
    )
    return merged


def print_table(results: dict) -> None:
    width = max(12, *(len(name) for rows in results.values() for name in rows))
    header = f"{'task':<11} {'setting':<{width}} " + " ".join(f"{p:>13}" for p in PHASES)
    print(
        header + f" {'passes':>7} {'prefill tok':>11} {'partial ep':>10} {'speed-up':>9}"
        f" {'1st step_s':>10}"
    )
    for task, rows in results.items():
        base = next(iter(rows.values()))["step_s"]
        for name, row in rows.items():
            cells = " ".join(f"{row[p]:>13.2f}" for p in PHASES)
            print(
                f"{task:<11} {name:<{width}} {cells} {row['train_passes']:>7.1f} "
                f"{row['prefill_tokens_computed']:>11.0f} {row['partial_episodes']:>10.1f} "
                f"{base / row['step_s']:>8.2f}x {row['first_step_s']:>10.2f}"
            )


def print_timeline(results: dict) -> None:
    """The `timeline` of each task and setting, phases as rows, settings as columns."""
    for task, rows in results.items():
        columns = {name: row["timeline"] for name, row in rows.items() if row.get("timeline")}
        if not columns:
            continue
        width = max(12, *(len(name) for name in columns))
        print(f"\n{task}: a step's timeline, seconds (means over the steps and repeats)")
        print(f"{'phase':<32} " + " ".join(f"{name:>{width}}" for name in columns))
        labels = [label for label, _ in TIMELINE] + ["unattributed", "cycle"]
        labels += ["rollout (wall, on the workers)"] + [label for label, _ in WORKER_TIMELINE]
        for label in labels:
            if label == "rollout (wall, on the workers)":
                print("rollout workers (seconds of work, concurrent):")
            cells = " ".join(f"{column[label]:>{width}.3f}" for column in columns.values())
            print(f"{label:<32} {cells}")


def main() -> None:
    stop_on_terminate()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="color_quiz,ave")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--settings",
        default="serial,shipped",
        help=f"settings to run, comma-separated, the first the baseline ({', '.join(SETTINGS)})",
    )
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="one more setting, as `areno train --set` overrides (repeatable)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an `areno train --set` override of every setting: the workload (repeatable)",
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="run every setting with the code of the checkout PATH too, as SETTING@NAME "
        "(repeatable; a before/after comparison in one run)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each setting, in turns")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/grpo_step.json"))
    args = parser.parse_args()
    settings, trees = parse_trees(args, parser, parse_settings(args, parser))
    results: dict[str, dict] = {}
    repeats: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="grpo_step_") as tmp:
        data, work = Path(tmp) / "data", Path(tmp) / "runs"
        work.mkdir(parents=True)
        for task in args.tasks.split(","):
            repeats[task] = {name: [] for name in settings}
            for turn, name in enumerate(in_turns(settings, args.repeats)):
                row = run(
                    task, name, settings[name], args.steps, data, work / str(turn), trees[name]
                )
                repeats[task][name].append(row)
                print(task, name, json.dumps(row), flush=True)
            results[task] = {
                name: {**settings[name], **mean_row(rows)} for name, rows in repeats[task].items()
            }
    print_table(results)
    print_timeline(results)
    meta = {
        "steps": args.steps,
        "settings": settings,
        "trees": {name: str(tree) for name, tree in trees.items()},
        "repeats": args.repeats,
        "mean_over": "steps 2..N, then the repeats",
    }
    write_results(args.out, meta, {"results": results, "repeats": repeats})


if __name__ == "__main__":
    main()
