"""Per-step metrics, written by trainer rank 0: always to metrics.jsonl (one object per line),
and to the experiment trackers `run.loggers` names: TensorBoard, Weights & Biases, MLflow.

A tracker is a small class with `log(step, scalars)` and `close()`, registered in `TRACKERS`;
the W&B and MLflow ones need their packages (the `wandb` / `mlflow` extras), which
`check_trackers` asks for before a run starts."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

from areno.errors import ConfigError

log = logging.getLogger("areno.train")

# tracker -> the module it imports, and the extra that installs it (none: a core dependency)
TRACKER_MODULES = {
    "tensorboard": ("tensorboardX", None),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
# The environment the W&B and MLflow clients read on rank 0, carried there from the driver
# (areno/train/run.py): a cluster's trainer workers do not inherit the driver's environment.
# Credentials are left out: log in on the node that runs rank 0 (`wandb login`, MLflow's own).
TRACKER_ENV = (
    "WANDB_MODE",
    "WANDB_PROJECT",
    "WANDB_ENTITY",
    "WANDB_BASE_URL",
    "WANDB_DIR",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_ALLOW_FILE_STORE",
)
# Where a run keeps its trackers' run ids, so a resumed run logs on to the same runs.
RUN_IDS = "trackers.json"


def check_trackers(trackers: list[str]) -> None:
    """Refuse, before a run starts, a tracker whose package is not installed (naming the
    extra that installs it) or that has nowhere to log."""
    for name in trackers:
        module, extra = TRACKER_MODULES[name]
        try:
            importlib.import_module(module)
        except ImportError:
            install = f"pip install 'areno[{extra}]'" if extra else f"pip install {module}"
            raise ConfigError(
                f"run.loggers names {name}, but the {module} package is not installed here: "
                f"{install}",
                param="loggers",
            ) from None
    if "mlflow" in trackers and not os.environ.get("MLFLOW_TRACKING_URI"):
        raise ConfigError(
            "run.loggers names mlflow: set MLFLOW_TRACKING_URI to the tracking server "
            "(http://HOST:5000), or to a local store (sqlite:///PATH/mlflow.db with the full "
            "mlflow package installed; file:PATH with MLFLOW_ALLOW_FILE_STORE=true)",
            param="loggers",
        )


class PhaseTimer:
    """Seconds per named phase of a GRPO step, as its `time/<phase>_s` metrics (a phase timed
    twice adds up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        return {f"time/{phase}_s": seconds for phase, seconds in self.seconds.items()}


class MetricsWriter:
    """metrics.jsonl and the trackers of `trackers`, each run named after the run directory
    (W&B's project and MLflow's experiment: `project`; `config`: the run's settings).

    A run that starts after `start_step` steps (resumed from its checkpoint) first drops the
    records it will write again: every step's after `start_step`, and the evaluation at
    `start_step` (written when the next step begins). So a resumed run's metrics.jsonl holds
    each step once; a new run in the directory (`start_step` 0) starts it afresh."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        trackers: list[str] | tuple[str, ...] = ("tensorboard",),
        *,
        project: str = "areno",
        config: dict | None = None,
        start_step: int = 0,
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_after(start_step)
        self._trackers = [TRACKERS[name](Path(run_dir), project, config or {}) for name in trackers]

    def _drop_after(self, start_step: int) -> None:
        if not self.path.is_file():
            return
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines if not _redone(json.loads(line), start_step)]
        if len(kept) < len(lines):
            self.path.write_text("".join(line + "\n" for line in kept))
            log.warning(
                "metrics.jsonl: dropped %d records of steps this run does again (it starts "
                "after step %d)",
                len(lines) - len(kept),
                start_step,
            )

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {
            key: float(value)
            for key, value in record.items()
            if key != "step" and isinstance(value, int | float) and math.isfinite(value)
        }
        for tracker in self._trackers:
            tracker.log(step, scalars)

    def close(self) -> None:
        for tracker in self._trackers:
            tracker.close()


class TensorBoard:
    def __init__(self, run_dir: Path, project: str, config: dict):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandB:
    """A W&B run in `project`, its files under the run directory (WANDB_MODE=offline keeps
    it there for a later `wandb sync`)."""

    def __init__(self, run_dir: Path, project: str, config: dict):
        import wandb

        run_id = _run_id(run_dir, "wandb", lambda: uuid.uuid4().hex[:16])
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", project),
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        # NOTE: W&B takes steps in order; an evaluation logs at the step the last training
        # step logged, which it merges into that step's row.
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class MLflow:
    """An MLflow run in experiment `project` on the tracking server of MLFLOW_TRACKING_URI,
    its parameters the run's settings (flattened, dotted)."""

    def __init__(self, run_dir: Path, project: str, config: dict):
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient()
        experiment = self._client.get_experiment_by_name(project)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(project)
        )

        def create() -> str:
            from mlflow.entities import Param

            run = self._client.create_run(experiment_id, run_name=run_dir.name)
            params = [Param(k, str(v)[:500]) for k, v in _flatten(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes 100 parameters a batch
                self._client.log_batch(run.info.run_id, params=params[start : start + 100])
            return run.info.run_id

        self._run_id = _run_id(run_dir, "mlflow", create)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in scalars.items()]
        for start in range(0, len(metrics), 1000):  # MLflow takes 1000 metrics a batch
            self._client.log_batch(self._run_id, metrics=metrics[start : start + 1000])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def _run_id(run_dir: Path, tracker: str, create) -> str:
    """The tracker's run id saved in the run directory (a resumed run's), else `create()`'s,
    saved."""
    path = run_dir / RUN_IDS
    ids = json.loads(path.read_text()) if path.is_file() else {}
    if tracker not in ids:
        ids[tracker] = create()
        path.write_text(json.dumps(ids, indent=2) + "\n")
    return ids[tracker]


def _flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _redone(record: dict[str, Any], start_step: int) -> bool:
    """Whether a run starting after `start_step` steps writes `record` again: a later step's,
    or the evaluation at its first step (a step's own record has its `step_s`)."""
    step = record.get("step", 0)
    return step > start_step or (step == start_step and "step_s" not in record)


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value
