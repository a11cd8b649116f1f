"""GRPO end to end on a Ray head: it learns, it resumes after a kill, it runs as a Ray job,
its private metadata stays private, and the frozen towers stay frozen.

One Ray head for the module (see conftest.py); each run is `areno train` in a subprocess, the
way a user launches it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areno.models.registry import adapter_for_checkpoint
from areno.train.metrics import read_metrics
from areno.train.policy import frozen_prefixes
from areno.train.sft import SFTConfig, sft
from tests.readme import block
from tests.train.canary_task import CANARY

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "color_quiz.yaml"
AREN0 = [sys.executable, "-m", "areno.cli"]
# A few cheap steps: one-token answers, 2 prompts x 2 samples.
SMALL = [
    "--group-size",
    "2",
    "--prompts-per-step",
    "2",
    "--eval-every",
    "0",
    "--set",
    "run.export_hf=false",
]


@pytest.fixture(scope="module")
def warm_start(tiny_path, tmp_path_factory) -> Path:
    """The format-only warm-start: the tiny Qwen3.5 answers with SOME option letter."""
    root = tmp_path_factory.mktemp("warm")
    config = SFTConfig(
        model_path=str(tiny_path("qwen3_5")),
        out_dir=str(root / "ckpt"),
        loader="areno.tasks.color_quiz:load",
        loader_kwargs={"num_samples": 256, "media_dir": str(root / "media")},
        target_key="warmup_answer",
        steps=60,
        lr=3e-3,
    )
    return sft(config, log=lambda _: None)


def _train(ray_head, *args: str, **kwargs) -> subprocess.CompletedProcess:
    result = ray_head.run(*AREN0, "train", "--no-progress", *args, cwd=REPO, **kwargs)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _last_per_step(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


@pytest.mark.slow
def test_grpo_learns_the_color_quiz(ray_head, tmp_path):
    """The README's color quiz commands, as written (tests/readme.py): a tiny Qwen3.5, its
    format-only warm start (it answers with SOME option letter, not the right one), then GRPO
    at the shipped config (the next step's rollout runs while the trainer trains, batched
    trainer passes). Held-out reward (greedy, 64 unseen images) rises by >= 0.25 over step 0."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    start = time.monotonic()
    result = ray_head.run("bash", "-ec", block("color_quiz").command(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    minutes = (time.monotonic() - start) / 60
    run_dir = tmp_path / "runs" / "color_quiz"
    records = read_metrics(run_dir)
    evals = _last_per_step(records, "eval/reward_mean")
    steps = sorted(evals)
    print(f"held-out reward by step: {evals}; {minutes:.1f} min")  # the curve, in the log
    assert steps[0] == 0 and evals[0] <= 0.5
    assert evals[steps[-1]] >= evals[0] + 0.25, evals
    # engine and trainer agree on the tokens of the policy being trained
    mismatch = _last_per_step(records, "logprob_mismatch_mean_abs")
    assert len(mismatch) == 30 and max(mismatch.values()) <= 1e-4
    # every step after the first trained on tokens one version old, none older
    steps_stale = _last_per_step(records, "staleness_max")
    assert set(steps_stale.values()) == {0.0, 1.0} and steps_stale[1] == 0.0
    assert all(
        r.get("staleness/1", 0) > 0 for r in records if r.get("step", 0) > 1 and "step_s" in r
    )
    # the first step's rollout ran alone; from the second, the next step's ran beside it
    ahead = _last_per_step(records, "rollouts_ahead")
    assert ahead[1] == 0 and ahead[30] == 0 and set(ahead[s] for s in range(2, 30)) == {1.0}
    passes = _last_per_step(records, "trajectories_per_pass")
    assert min(v for v in passes.values() if v) > 1  # several trajectories per forward
    png = run_dir / "curves.png"  # the README's `areno plot`
    assert png.stat().st_size > 10_000
    shutil.copy(png, tmp_path / "color_quiz_curve.png")
    _assert_towers_frozen(tmp_path / "runs" / "warm", run_dir / "hf", records)


def _assert_towers_frozen(before: Path, after: Path, records: list[dict]) -> None:
    adapter = adapter_for_checkpoint(before)
    prefixes = frozen_prefixes(adapter, towers=True, projectors=True)
    old, new = load_file(before / "model.safetensors"), load_file(after / "model.safetensors")
    frozen = [name for name in old if any(name.startswith(p + ".") for p in prefixes)]
    assert frozen and all(torch.equal(old[name], new[name]) for name in frozen)
    trained = [name for name in old if name not in frozen]
    assert any(not torch.equal(old[name], new[name]) for name in trained)
    expected = sum(old[name].numel() for name in trained)
    assert {r["trainable_params"] for r in records if "trainable_params" in r} == {expected}


@pytest.mark.slow
def test_lora_grpo_learns_the_color_quiz(ray_head, warm_start, tmp_path):
    """The README's LoRA command as written (tests/readme.py): the shipped color quiz config
    with LoRA adapters on the language model, the weight sync sending only their factors.
    Held-out reward rises by >= 0.25; the engine's logprobs are the trainer's (it runs the
    synced adapters); the exported PEFT adapter, loaded with peft on plain transformers, is
    the trained policy."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "warm").symlink_to(warm_start)
    result = ray_head.run("bash", "-ec", block("lora").command(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    run_dir = tmp_path / "runs" / "color_quiz_lora"
    records = read_metrics(run_dir)
    evals = _last_per_step(records, "eval/reward_mean")
    print(f"held-out reward by step (LoRA): {evals}")
    assert evals[max(evals)] >= evals[0] + 0.25, evals
    mismatch = _last_per_step(records, "logprob_mismatch_mean_abs")
    assert max(mismatch.values()) <= 1e-4
    adapter_dir = run_dir / "adapter"
    assert not (run_dir / "hf").exists()
    factors = load_file(adapter_dir / "adapter_model.safetensors")
    assert factors and all(".lora_A." in n or ".lora_B." in n for n in factors)
    trainable = {r["trainable_params"] for r in records if "trainable_params" in r}
    assert trainable == {sum(t.numel() for t in factors.values())}
    _assert_peft_loads_the_policy(warm_start, adapter_dir, evals[max(evals)])


# The recipes of docs/architecture.md ("How a GRPO step runs"), as the shipped configs write them:
# GSPO as its paper runs it (the sequence's ratio, its mean over its tokens, its truncated IS
# weight) and DAPO (dynamic sampling, clip-higher).
RECIPES = {
    "gspo": REPO / "configs" / "color_quiz_gspo.yaml",
    "dynamic_sampling": REPO / "configs" / "color_quiz_dapo.yaml",
}
RECIPE_STEPS = 40  # from the fixture's warm start: at 30 a run reached 0.5 from 0.25, at 20 none


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_learns_the_color_quiz(ray_head, warm_start, tmp_path, recipe):
    """GSPO, and DAPO's dynamic sampling, each trained from the format-only warm start at its
    shipped config: held-out reward (greedy, 64 unseen images) rises by >= 0.25 over step 0, and the
    metrics say the recipe ran (GSPO: one optimizer step a batch, so the sequence ratio is 1
    and nothing is clipped; dynamic sampling: groups whose rewards are all equal were dropped
    and only groups with signal trained)."""
    _, steps = _learn_from_warm_start(
        ray_head, RECIPES[recipe], warm_start, tmp_path, RECIPE_STEPS, recipe
    )
    if recipe == "gspo":
        assert all(r["ratio_mean"] == pytest.approx(1.0, abs=1e-4) for r in steps)
        assert all(r["clip_fraction"] == 0.0 for r in steps)
    else:
        assert sum(r["groups_dropped"] for r in steps) > 0
        for r in steps:
            trained = r["train_passes"] * r["trajectories_per_pass"]
            assert trained == pytest.approx(8 * r["groups_kept"])  # group_size 8: kept alone


def _learn_from_warm_start(ray_head, config, warm_start, tmp_path, steps: int, what: str):
    """Train `config` from the warm start for `steps` steps, evaluating at 0 and `steps`; assert
    held-out reward rose by >= 0.25 from at most 0.5. The metrics records, and those of steps."""
    run_dir = tmp_path / "run"
    args = [
        *("--config", str(config), "--model-path", str(warm_start)),
        *("--run-dir", str(run_dir)),
        *("--max-steps", str(steps), "--eval-every", str(steps)),
        *("--set", "run.export_hf=false", "--set", "run.save_every=0"),
    ]
    _train(ray_head, *args)
    records = read_metrics(run_dir)
    evals = _last_per_step(records, "eval/reward_mean")
    print(f"held-out reward by step ({what}): {evals}")
    assert sorted(evals) == [0, steps] and evals[0] <= 0.5
    assert evals[steps] >= evals[0] + 0.25, evals
    step_records = [r for r in records if "step_s" in r]
    assert len(step_records) == steps
    return records, step_records


SDK_CONFIG = REPO / "examples" / "agent_program" / "sdk_agent.yaml"
SDK_STEPS = (
    40  # five seeds: held-out 0.25 -> 0.5 by step 10, 0.5 to 0.75 at 40 (docs/agent-programs.md)
)


@pytest.mark.slow
def test_agents_sdk_program_learns_the_color_quiz(ray_head, warm_start, tmp_path):
    """An OpenAI Agents SDK agent with one function tool (examples/agent_program/sdk_agent.py:
    a forced `answer(letter)` call), trained as it is from the format-only warm start at its
    shipped config: held-out reward (greedy, 64 unseen images, the same program) rises by
    >= 0.25 over step 0. Every episode is the SDK's one call, a whole tool call the SDK ran,
    of which the model sampled (and the trainer trained) the letter alone."""
    pytest.importorskip("agents", reason="the Agents SDK: pip install -e '.[agents]'")
    records, steps = _learn_from_warm_start(
        ray_head, SDK_CONFIG, warm_start, tmp_path, SDK_STEPS, "Agents SDK"
    )
    for r in steps:
        assert r["program_calls_per_episode"] == 1.0 and r["tool_calls_per_episode"] == 1.0
        assert r["malformed_tool_calls"] == 0.0 and r["program_failed_episodes"] == 0.0
        assert r["response_len_mean"] == 1.0  # the letter: the server wrote the rest
    assert _last_per_step(records, "eval/tool_calls_per_episode") == {0: 1.0, SDK_STEPS: 1.0}


def _assert_peft_loads_the_policy(base: Path, adapter_dir: Path, held_out: float) -> None:
    """peft on plain transformers, base checkpoint plus exported adapter: the base weights are
    untouched, and its greedy answers to the 64 held-out questions score what the engine's did
    at the last evaluation (the same policy; a tie in the logits may fall either way)."""
    import peft

    from areno.media import MediaDecoder, MediaPolicy
    from areno.processing import Processor, process_messages
    from areno.tasks.color_quiz import chosen_options, load

    model = adapter_for_checkpoint(base).load_model(base).eval()
    plain = {n: p.clone() for n, p in model.named_parameters()}
    tuned = peft.PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    processor = Processor(base)
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    samples = list(load(split="validation", num_samples=64))
    correct = 0
    for sample in samples:
        inputs = process_messages(processor, decoder, sample.messages)
        out = tuned.generate(**inputs.model_inputs(), max_new_tokens=1, do_sample=False)
        text = processor.tokenizer.decode(out[0, inputs.num_prompt_tokens :])
        correct += chosen_options(text, sample.private["options"]) == {sample.private["answer"]}
    after = {
        name.replace(".base_layer", ""): param
        for name, param in tuned.get_base_model().named_parameters()
        if ".lora_" not in name
    }
    assert after.keys() == plain.keys()
    assert all(torch.equal(plain[name], after[name]) for name in plain)
    assert abs(correct / len(samples) - held_out) <= 2 / len(samples), (correct, held_out)


def test_resume_after_kill_continues_the_step_count_and_data(ray_head, warm_start, tmp_path):
    """A run killed after a checkpoint resumes with --resume exactly after it. The run trains
    LoRA adapters under ZeRO-3 (every parameter partitioned over the ranks, the frozen base
    too): their checkpoint, weight sync and export; the full-parameter checkpoint resumes in
    tests/train/test_faults.py."""
    run_dir = tmp_path / "run"
    args = [
        "--config",
        str(CONFIG),
        "--model-path",
        str(warm_start),
        "--run-dir",
        str(run_dir),
        "--save-every",
        "1",
        *SMALL,
        *("--zero-stage", "3", "--set", "lora.rank=4", "--set", "lora.alpha=8"),
    ]
    # The trainer actors outlive the killed driver for a moment and may save a few more steps:
    # the killed run has room for them, the resumed one runs two steps past its checkpoint.
    process = subprocess.Popen(
        [*AREN0, "train", "--no-progress", *args, "--max-steps", "8"],
        cwd=REPO,
        env=ray_head.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    state_file = run_dir / "trainer_state.json"
    deadline = time.monotonic() + 600
    while not state_file.exists():
        assert process.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    saved = json.loads(state_file.read_text())
    assert 1 <= saved["step"] < 8 and saved["data_position"] == 2 * saved["step"]

    last = saved["step"] + 2
    _train(ray_head, *args, "--max-steps", str(last), "--resume")
    records = read_metrics(run_dir)
    positions = _last_per_step(records, "data_position")
    # every step ran, each consumed exactly its 2 prompts, and the resumed run began right
    # after the checkpoint (not at 0, not after the step the killed run may have reached)
    assert {step: positions[step] for step in range(1, last + 1)} == {
        step: 2 * step for step in range(1, last + 1)
    }
    resumed = [r["step"] for r in records if "data_position" in r][-2:]
    assert resumed == [saved["step"] + 1, last]
    # each step's record once: the resumed run dropped those it did again
    assert [r["step"] for r in records if "step_s" in r] == list(range(1, last + 1))
    assert json.loads(state_file.read_text())["step"] == last
    factors = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert factors and all(".lora_A." in n or ".lora_B." in n for n in factors)
    assert any(t.abs().sum() > 0 for n, t in factors.items() if ".lora_B." in n)  # trained


def test_ray_job_submit_runs_training_and_private_data_stays_private(
    ray_head, warm_start, tmp_path
):
    workdir = tmp_path / "job"
    workdir.mkdir()
    shutil.copy(Path(__file__).with_name("canary_task.py"), workdir / "canary_task.py")
    run_dir = tmp_path / "run"
    config = CONFIG.read_text().replace("areno.tasks.color_quiz:", "canary_task:")
    (workdir / "grpo.yaml").write_text(config)
    entry = [
        sys.executable,
        "-m",
        "areno.cli",
        "train",
        "--no-progress",
        "--config",
        "grpo.yaml",
        "--model-path",
        str(warm_start),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        "2",
        *SMALL,
        # the multi-rank path: 2 trainer workers under ZeRO-3, KL to the frozen reference,
        # recomputed behaviour logprobs with truncated importance sampling
        *("--num-trainer-workers", "2", "--zero-stage", "3"),
        *("--set", "trainer.num_cpus_per_worker=0.25", "--set", "grpo.loss.kl_coef=0.01"),
        *("--set", "grpo.behaviour_logprobs=recompute"),
        *("--set", "grpo.loss.rollout_correction=token_tis", "--set", "grpo.loss.tis_cap=2.0"),
        *("--set", "run.export_hf=true"),
        # serial steps: step 2's rollout starts on step 1's weights
        *("--set", "rollout.max_staleness=0"),
    ]
    for _ in range(180):  # the job agent comes up after the dashboard (later when busy)
        submitted = ray_head.run(
            "ray",
            "job",
            "submit",
            f"--address={ray_head.dashboard}",
            f"--working-dir={workdir}",
            "--",
            *entry,
        )
        if "No available agent" not in submitted.stdout + submitted.stderr:
            break
        time.sleep(1)
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    assert "areno train: done" in submitted.stdout
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2]
    for key in (
        "reward_std",
        "accuracy",
        "response_len_mean",
        "tool_calls_per_episode",
        "kl",
        "clip_fraction",
        "logprob_mismatch_mean_abs",
        "rollout_tokens_per_s",
        "rollout_s",
        "reward_s",
        "train_s",
        "weight_sync_s",
        "policy_version",
    ):
        assert key in records[-1], key
    assert records[-1]["policy_version"] == 1  # step 2's rollouts ran on step 1's weights
    # The step's prompt tokens, and those the rollout engines' prefix cache spared.
    last = records[-1]
    assert last["prefill_tokens_requested"] > 0
    assert 0 <= last["prefill_tokens_computed"] <= last["prefill_tokens_requested"]
    assert 0 <= last["prefix_hit_rate"] <= 1
    assert records[-1]["kl"] > 0 and records[-1]["logprob_mismatch_mean_abs"] <= 1e-4
    _assert_timeline(records[-1])
    _assert_serving_classes_load(run_dir / "hf")
    # the canary reached the reward (it raises otherwise) and nothing else
    leaks = [
        str(path)
        for root in (run_dir, ray_head.temp_dir)
        for path in Path(root).rglob("*")
        if path.is_file() and not path.is_symlink() and _contains(path, CANARY)
    ]
    assert not leaks and CANARY not in submitted.stdout + submitted.stderr


# A step's phases on rank 0, in the order they run (`time/*` metrics; the record and checkpoint
# are the step before's).
RANK0_PHASES = (
    "record",
    "checkpoint",
    "launch",
    "rollout_wait",
    "reward",
    "advantages",
    "packing",
    "scatter",
    "train",
    "weight_sync",
    "broadcast",
)
WORKER_PHASES = ("media", "process", "generate", "prefill", "decode", "media_encode")


def _assert_timeline(record: dict) -> None:
    """A step's timeline: every phase timed, none negative, and together no longer than the
    step's cycle (the step before's end to this step's end); the trainer's forward, backward
    and optimizer within its train time; the rollout workers' phases reported."""
    phases = [record[f"time/{name}_s"] for name in RANK0_PHASES]
    assert all(seconds >= 0 for seconds in phases), phases
    assert record["step_s"] <= record["time/cycle_s"]
    assert sum(phases) <= record["time/cycle_s"] + 1e-3
    parts = [record[f"time/{name}_s"] for name in ("forward", "backward", "optimizer")]
    assert all(seconds > 0 for seconds in parts), parts
    # the slowest rank's three phases, timed in its own process: within rank 0's train time
    # but for the scatter's hand-over between the two processes
    assert sum(parts) <= record["time/train_s"] + 0.01
    assert record["time/train_s"] == record["train_s"]
    workers = [record[f"time/rollout/{name}_s"] for name in WORKER_PHASES]
    assert all(seconds >= 0 for seconds in workers), workers
    # every step processes and prefills prompts (one-token answers: maybe no decode-only step;
    # an image seen before is answered by the decoder's and the towers' caches)
    assert min(record[f"time/rollout/{name}_s"] for name in ("process", "prefill")) > 0


def _assert_serving_classes_load(checkpoint: Path) -> None:
    """The exported checkpoint runs on the serving classes (decoder, processor, generator)."""
    from areno.data import load_samples
    from areno.engine.config import EngineConfig
    from areno.engine.sampling import SamplingParams
    from areno.rollout.worker import RolloutSpec, RolloutWorker

    worker = RolloutWorker(RolloutSpec(str(checkpoint), EngineConfig(max_context_len=256)))
    try:
        sample = next(load_samples("areno.tasks.color_quiz:load", num_samples=1))
        params = SamplingParams(temperature=0, max_tokens=4)
        result = asyncio.run(worker.run_group(sample.id, sample.messages, 1, params))
        trajectories = result.trajectories
        assert trajectories[0].num_generated_tokens >= 1
    finally:
        worker.shutdown()


def _contains(path: Path, needle: str) -> bool:
    try:
        return needle.encode() in path.read_bytes()
    except OSError:
        return False
