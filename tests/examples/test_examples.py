"""Every example end to end, and its parts one by one.

- Smoke: generate a tiny dataset with the example's own script (once per module, shared by every
  test here), run `areno train` (2 steps) in a subprocess against the module's Ray head, check
  metrics.jsonl. Random tiny weights rarely emit a well-formed tool call, so this checks the loop
  runs, not what the agent learns.
- Tools: called on real generated clips / images (frames come back, audio has the right length,
  a bad range is a ToolError message for the model).
- Rewards: hand-made trajectories.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf
from PIL import Image

from areno.data.guard import PUBLIC_VALUES
from areno.processing.types import PromptInputs
from areno.rollout.agent import ToolContext
from areno.rollout.trajectory import ToolCallRecord, Trajectory
from areno.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
AVE = REPO / "examples" / "multimodal" / "ave_event_recognition"
VL = REPO / "examples" / "vl"
SMOKE_FLAGS = [
    "--max-steps",
    "2",
    "--group-size",
    "2",
    "--prompts-per-step",
    "2",
    "--eval-every",
    "0",
    "--set",
    "run.export_hf=false",
]
# name -> (generator script, config, tiny family)
EXAMPLES = {
    "ave": (AVE / "generate_dataset.py", AVE / "grpo.yaml", "gemma4"),
    "vl_counting": (
        VL / "counting" / "generate_dataset.py",
        VL / "counting" / "grpo.yaml",
        "qwen3_5",
    ),
    "vl_compare": (VL / "compare" / "generate_dataset.py", VL / "compare" / "grpo.yaml", "qwen3_5"),
}
GENERATE_FLAGS = ["--num-train", "4", "--num-validation", "2", "--no-progress"]


def generate(scripts: dict[str, Path], root: Path) -> dict[str, Path]:
    """Run each dataset script as its README does (`python SCRIPT --out DIR`) into root / name,
    with 4 train and 2 validation samples. The scripts run at once: each spends its seconds
    importing torch (through areno), not writing its few samples."""
    processes = {
        name: subprocess.Popen(
            [sys.executable, str(script), "--out", str(root / name), *GENERATE_FLAGS],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, script in scripts.items()
    }
    try:
        for name, process in processes.items():
            _, stderr = process.communicate(timeout=300)
            assert process.returncode == 0, f"{scripts[name]}: {stderr[-3000:]}"
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return {name: root / name for name in scripts}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    """Every example's tiny dataset, written once for the module by its own script."""
    scripts = {name: script for name, (script, _, _) in EXAMPLES.items()}
    return generate(scripts, tmp_path_factory.mktemp("datasets"))


def trajectory(*calls: tuple[str, dict | str], final_text: str = "") -> Trajectory:
    """A hand-made trajectory holding only what rewards read: tool calls and the final text."""
    records = [
        ToolCallRecord(turn, name, args if isinstance(args, str) else json.dumps(args), "")
        for turn, (name, args) in enumerate(calls)
    ]
    inputs = PromptInputs(input_ids=[1, 2, 3], mm_inputs={})
    return Trajectory(
        "s", 0, inputs, 3, [0, 0, 0], [0.0] * 3, [0], final_text=final_text, tool_calls=records
    )


def ctx_for(sample) -> ToolContext:
    public = sample.public()
    return ToolContext(public.id, public.messages)


# --- smoke: every example trains 2 steps --------------------------------------------------------


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_trains_two_steps(name, ray_head, tiny_path, datasets, tmp_path):
    _, config, family = EXAMPLES[name]
    data = datasets[name]
    run_dir = tmp_path / "run"
    flags = list(SMOKE_FLAGS)
    if name == "ave":  # held out: 2 clips x grpo.yaml's eval_samples_per_prompt (2), sampled
        flags += ["--eval-every", "2"]
    ray_head.env["ARENO_LOG_COMPLETIONS"] = "1" if name == "ave" else "0"
    ray_head.env["RAY_DEDUP_LOGS"] = "0"  # every completion line reaches the driver's output
    result = ray_head.run(
        sys.executable, "-m", "areno.cli", "train", "--no-progress", "--config", str(config),
        "--model-path", str(tiny_path(family)), "--run-dir", str(run_dir), *flags,
        "--set", f"data.loader_kwargs.path={data}", "--set", f"data.eval_loader_kwargs.path={data}",
        cwd=REPO, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    records = read_metrics(run_dir)
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all("tool_calls_per_episode" in r for r in steps)
    if name == "ave":
        evals = [r for r in records if "eval/reward_mean" in r]
        assert [(r["step"], r["eval/episodes"]) for r in evals] == [(0, 4.0), (2, 4.0)]
        # the step's timeline: step 1 ran the evaluation at step 0; step 2's cycle holds it all
        assert steps[0]["time/eval_s"] >= evals[0]["eval_s"] > 0
        assert steps[1]["time/cycle_s"] >= steps[1]["step_s"] > steps[1]["time/train_s"]
        assert steps[1]["time/rollout/media_s"] > 0
        # the engine's seconds between two gathers: overlapped, step 1's may hold step 2's
        assert sum(r["time/rollout/prefill_s"] for r in steps) > 0
        # ARENO_LOG_COMPLETIONS=1 reached the rollout workers of the running cluster: a line per
        # turn (the scripted episodes of tests/rollout show calls parsed and executed in it)
        logged = [
            json.loads(line.split("completion ", 1)[1])
            for line in (result.stdout + result.stderr).splitlines()
            if "areno.rollout.completions: completion {" in line
        ]
        episodes = 2 * 2 * 2 + 2 * 4  # training: 2 steps x 2 prompts x 2; held out: 2 x 4
        assert len(logged) >= episodes and all("tool_calls" in r for r in logged)


# --- AVE: tools on a real clip, reward on hand-made trajectories ---------------------------------


@pytest.fixture(scope="module")
def ave_sample(datasets):
    from examples.multimodal.ave_event_recognition.loader import load

    return next(iter(load(str(datasets["ave"]), "train")))


def test_ave_dataset_is_deterministic_and_keeps_answers_private(datasets, tmp_path):
    from examples.multimodal.ave_event_recognition.generate_dataset import main

    a = datasets["ave"]  # the script's run in a process of its own
    b = tmp_path / "b"
    main(["--out", str(b), *GENERATE_FLAGS])  # a second run, here
    rows_a = [json.loads(line) for line in (a / "train.jsonl").read_text().splitlines()]
    rows_b = [json.loads(line) for line in (b / "train.jsonl").read_text().splitlines()]
    assert [r["private"] for r in rows_a] == [r["private"] for r in rows_b]
    for row in rows_a:
        keys = {"label", "start_s", "end_s", "duration_s", "warmup_call", PUBLIC_VALUES}
        assert set(row["private"]) == keys
        [call] = row["private"]["warmup_call"]["tool_calls"]  # the sft format target
        assert call["name"] == "submit_answer"
        assert set(call["arguments"]) == {"label", "start_s", "end_s"}
        assert row["private"]["label"] not in json.dumps(row["messages"]).split("Classes:")[0]


def test_ave_view_frames_returns_frames_of_the_range(ave_sample, tmp_path, monkeypatch):
    from examples.multimodal.ave_event_recognition.agent import ave_agent

    monkeypatch.setenv("ARENO_CACHE_DIR", str(tmp_path))
    result = ave_agent(max_frames=3).call_tool(
        "view_frames", {"start_s": 1, "end_s": 3}, ctx_for(ave_sample)
    )
    images = [p for p in result if p["type"] == "image_url"]
    assert result[0]["type"] == "text" and len(images) == 3
    times = [float(t) for t in result[0]["text"].split("=")[1].split("s")[0].split(",")]
    assert all(1 <= t < 3 for t in times)
    with Image.open(images[0]["image_url"]["url"]) as image:
        assert image.size == (64, 64)


def test_ave_listen_returns_audio_of_the_right_length(ave_sample, tmp_path, monkeypatch):
    from examples.multimodal.ave_event_recognition.agent import ave_agent

    monkeypatch.setenv("ARENO_CACHE_DIR", str(tmp_path))
    result = ave_agent().call_tool("listen", {"start_s": 0.5, "end_s": 2}, ctx_for(ave_sample))
    info = sf.info(result[1]["audio_url"]["url"])
    assert result[1]["type"] == "audio_url" and abs(info.duration - 1.5) < 1e-3


@pytest.mark.parametrize(
    ("tool", "arguments", "message"),
    [
        ("view_frames", {"start_s": 3, "end_s": 9}, "bad range [3, 9)"),
        ("view_frames", {"start_s": 2, "end_s": 1}, "bad range"),
        ("listen", {"start_s": -1, "end_s": 1}, "bad range"),
        ("listen", {"start_s": "soon", "end_s": 1}, "start_s must be a number"),
        ("listen", {"end_s": 1}, "missing argument 'start_s'"),
        ("submit_answer", {"label": "", "start_s": 0, "end_s": 1}, "label must be"),
        ("nope", {}, "unknown tool"),
    ],
)
def test_ave_bad_calls_become_error_messages(ave_sample, tool, arguments, message):
    from examples.multimodal.ave_event_recognition.agent import ave_agent

    result = ave_agent().call_tool(tool, arguments, ctx_for(ave_sample))
    assert isinstance(result, str) and result.startswith("error:") and message in result


def test_ave_tools_read_data_url_clips(tmp_path, monkeypatch):
    from examples.multimodal.ave_event_recognition.agent import ave_agent
    from examples.multimodal.ave_event_recognition.generate_dataset import main
    from examples.multimodal.ave_event_recognition.loader import load

    monkeypatch.setenv("ARENO_CACHE_DIR", str(tmp_path))
    main(["--out", str(tmp_path / "d"), "--num-train", "1", "--num-validation", "1",
          "--data-urls", "--no-progress"])  # fmt: skip
    sample = next(iter(load(str(tmp_path / "d"))))
    assert ctx_for(sample).media_urls("video")[0].startswith("data:video/mp4;base64,")
    result = ave_agent().call_tool("listen", {"start_s": 0, "end_s": 1}, ctx_for(sample))
    assert abs(sf.info(result[1]["audio_url"]["url"]).duration - 1.0) < 1e-3


AVE_PRIVATE = {"label": "dog barking", "start_s": 1.0, "end_s": 3.0, "duration_s": 5.0}


@pytest.mark.parametrize(
    ("calls", "expected"),
    [
        ([("submit_answer", {"label": "dog barking", "start_s": 1, "end_s": 3})],
         {"label": 1.0, "segment": 0.5, "format": 0.2}),
        ([("submit_answer", {"label": "barking dog", "start_s": 2, "end_s": 3})],
         {"label": 1.0, "segment": 0.25, "format": 0.2}),
        ([("view_frames", {"start_s": 0, "end_s": 5}),
          ("submit_answer", {"label": "the dog", "start_s": "1", "end_s": "3"})],
         {"label": 1.0, "segment": 0.5, "format": 0.2}),
        ([("submit_answer", {"label": "violin", "start_s": 3, "end_s": 5})],
         {"label": 0.0, "segment": 0.0, "format": 0.2}),
        ([("submit_answer", {"label": "dog barking", "start_s": 3, "end_s": 1})],
         {"label": 1.0, "segment": 0.0, "format": 0.0}),
        ([("submit_answer", "{not json")], {"label": 0.0, "segment": 0.0, "format": 0.0}),
        ([("listen", {"start_s": 0, "end_s": 2})], {"label": 0.0, "segment": 0.0, "format": 0.0}),
    ],
)  # fmt: skip
def test_ave_reward(calls, expected):
    from examples.multimodal.ave_event_recognition.reward import reward

    assert reward(trajectory(*calls), AVE_PRIVATE) == pytest.approx(expected)


def test_ave_reward_needs_the_private_answer():
    from areno.rewards import RewardError
    from examples.multimodal.ave_event_recognition.reward import reward

    with pytest.raises(RewardError, match="label"):
        reward(trajectory(), {"start_s": 0, "end_s": 1})


# --- visual agents --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vl_samples(datasets):
    from examples.vl.compare.loader import load as load_compare
    from examples.vl.counting.loader import load as load_counting

    counting = next(iter(load_counting(str(datasets["vl_counting"]))))
    return counting, next(iter(load_compare(str(datasets["vl_compare"]))))


def test_crop_and_zoom_returns_the_enlarged_region(vl_samples):
    from examples.vl.counting.agent import counting_agent

    sample = vl_samples[0]
    x0, y0, x1, y1 = sample.private["boxes"][0]
    box = {"x0": x0, "y0": y0, "x1": x1, "y1": y1}
    result = counting_agent(zoom=2).call_tool("crop_and_zoom", box, ctx_for(sample))
    with Image.open(result[1]["image_url"]["url"]) as crop:
        assert crop.size == (2 * (x1 - x0), 2 * (y1 - y0))
        # the target object fills the crop's centre: not background gray
        assert (
            max(crop.getpixel((crop.width // 2, crop.height // 2))) < 230
            or min(crop.getpixel((crop.width // 2, crop.height // 2))) < 100
        )


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"x0": 0, "y0": 0, "x1": 500, "y1": 10}, "must satisfy 0 <= x0 < x1 <= 128"),
        ({"x0": 10, "y0": 0, "x1": 5, "y1": 10}, "must satisfy"),
        ({"x0": 0, "y0": 0, "x1": 2, "y1": 2}, "too small"),
        ({"x0": 0.5, "y0": 0, "x1": 20, "y1": 20}, "x0 must be an integer"),
        ({"x0": 0, "y0": 0, "x1": 20}, "missing argument 'y1'"),
    ],
)
def test_crop_and_zoom_bad_boxes_become_error_messages(vl_samples, arguments, message):
    from examples.vl.counting.agent import counting_agent

    result = counting_agent().call_tool("crop_and_zoom", arguments, ctx_for(vl_samples[0]))
    assert isinstance(result, str) and message in result


def test_compare_tools(vl_samples):
    from examples.vl.compare.agent import GAP, compare_agent

    sample, agent = vl_samples[1], compare_agent()
    ctx = ctx_for(sample)
    result = agent.call_tool("side_by_side", {}, ctx)
    with Image.open(result[1]["image_url"]["url"]) as both:
        assert both.size == (2 * 96 + GAP, 96)
    crop = agent.call_tool("crop", {"image": 2, "x0": 0, "y0": 0, "x1": 48, "y1": 48}, ctx)
    with Image.open(crop[1]["image_url"]["url"]) as image:
        assert image.size == (96, 96)
    assert "image must be 1 or 2" in agent.call_tool(
        "crop", {"image": 3, "x0": 0, "y0": 0, "x1": 8, "y1": 8}, ctx
    )
    assert "takes no arguments" in agent.call_tool("side_by_side", {"zoom": 2}, ctx)


@pytest.mark.parametrize(
    ("count", "expected"),
    [(3, {"count": 1.0, "format": 0.2}), ("three", {"count": 1.0, "format": 0.2}),
     (4, {"count": 0.25, "format": 0.2}), (6, {"count": 0.0, "format": 0.2}),
     ("many", {"count": 0.0, "format": 0.2}), (None, {"count": 0.0, "format": 0.0})],
)  # fmt: skip
def test_counting_reward(count, expected):
    from examples.vl.counting.reward import reward

    calls = [] if count is None else [("submit_answer", {"count": count})]
    assert reward(trajectory(*calls), {"count": 3}) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("choice", "expected"),
    [("second", 1.0), ("the right one", 1.0), ("image 2", 1.0), ("first", 0.0),
     ("first or second", 0.0)],
)  # fmt: skip
def test_compare_reward(choice, expected):
    from examples.vl.compare.reward import reward

    traj = trajectory(("submit_answer", {"choice": choice}))
    assert reward(traj, {"answer": "second"}) == pytest.approx({"choice": expected, "format": 0.2})
