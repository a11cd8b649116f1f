"""`areno plot RUN_DIR`: PNG curves from a run's metrics.jsonl."""

from __future__ import annotations

import os
from pathlib import Path

from areno.errors import ConfigError
from areno.train.metrics import read_metrics

DEFAULT_KEYS = (
    "eval/reward_mean",
    "reward_mean",
    "accuracy",
    "response_len_mean",
    "logprob_mismatch_mean_abs",
    "clip_fraction",
    "kl",
    "step_s",
)


def plot_run(
    run_dir: str | os.PathLike, out: str | os.PathLike | None = None, keys=DEFAULT_KEYS
) -> Path:
    """One panel per metric present in the run; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        raise ConfigError(f"{run_dir} has no metrics.jsonl records to plot")
    present = [k for k in keys if any(k in r for r in records)]
    columns = 2
    rows = max(1, -(-len(present) // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3 * rows), squeeze=False)
    for ax, key in zip(axes.flat, present, strict=False):
        points = [(r["step"], r[key]) for r in records if key in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present) :]:
        ax.axis("off")
    fig.tight_layout()
    path = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
