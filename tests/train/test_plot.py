"""`areno plot`: one panel per chosen metric of a run's metrics.jsonl."""

from __future__ import annotations

from PIL import Image

from areno.cli import main
from areno.train.metrics import MetricsWriter


def test_plot_draws_the_chosen_keys(tmp_path, capsys):
    writer = MetricsWriter(tmp_path, trackers=())
    for step in range(1, 5):
        writer.write(step, {"reward_mean": 0.1 * step, "tool_calls_per_episode": 0.5})
    writer.write(4, {"eval/reward_mean": 0.3})
    writer.close()
    out = tmp_path / "c.png"
    keys = ["eval/reward_mean", "reward_mean", "tool_calls_per_episode", "absent"]
    assert main(["plot", str(tmp_path), "--out", str(out), "--keys", *keys]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    # three panels present (the absent key is left out): 2 columns x 2 rows of 5 x 3 inches
    assert Image.open(out).size == (1000, 600)
    assert main(["plot", str(tmp_path / "empty")]) == 2


def test_a_resumed_run_writes_each_step_once(tmp_path):
    """A run killed after writing steps 1-5 (its checkpoint at step 3, evaluations at 0 and 3)
    and resumed from step 3 drops what it does again, steps 4-5 and the evaluation at 3, so
    metrics.jsonl holds each step once; a new run in the directory starts it afresh."""
    from areno.train.metrics import read_metrics

    killed = MetricsWriter(tmp_path, trackers=())
    killed.write(0, {"eval/reward_mean": 0.1})
    for step in range(1, 6):
        if step == 4:
            killed.write(3, {"eval/reward_mean": 0.2})
        killed.write(step, {"step_s": 1.0, "run": "killed"})
    killed.close()
    resumed = MetricsWriter(tmp_path, trackers=(), start_step=3)
    resumed.write(3, {"eval/reward_mean": 0.3})
    for step in range(4, 7):
        resumed.write(step, {"step_s": 1.0, "run": "resumed"})
    resumed.close()
    records = read_metrics(tmp_path)
    steps = [r["step"] for r in records if "step_s" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [r["run"] for r in records if "step_s" in r] == ["killed"] * 3 + ["resumed"] * 3
    assert [r["eval/reward_mean"] for r in records if "step_s" not in r] == [0.1, 0.3]
    MetricsWriter(tmp_path, trackers=()).close()
    assert read_metrics(tmp_path) == []
