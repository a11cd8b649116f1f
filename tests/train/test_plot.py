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
