"""Checkpoints (DeepSpeed state + where the data stream stands) and Hugging Face export.

Layout under the run directory:
  checkpoints/step_N/...    DeepSpeed's model / optimizer shards (every rank writes its own)
  checkpoints/latest        the newest tag (DeepSpeed writes it)
  trainer_state.json        step, data position, tag and launch id of the newest checkpoint
  hf/                       a Hugging Face checkpoint directory `areno serve` loads
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from areno.train.weight_sync import gathered

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass
class TrainState:
    """What a resumed run needs besides the weights: how far it got."""

    step: int = 0  # optimizer steps done
    data_position: int = 0  # training samples consumed from the stream

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def has_checkpoint(run_dir: str | os.PathLike) -> bool:
    return (checkpoint_dir(run_dir) / "latest").is_file()


def save(
    deepspeed: Any,
    run_dir: str | os.PathLike,
    state: TrainState,
    *,
    rank: int,
    launch_id: str | None = None,
) -> Path:
    """Every rank saves its shards; rank 0 then records the state next to them, with the id of
    the `areno train` launch that saved it (see `saved_by`)."""
    tag = f"step_{state.step}"
    deepspeed.save_checkpoint(str(checkpoint_dir(run_dir)), tag=tag, client_state=state.to_dict())
    if rank == 0:
        path = Path(run_dir) / "trainer_state.json"
        tmp = path.with_suffix(".tmp")
        record = {**state.to_dict(), "tag": tag, "launch_id": launch_id}
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(path)
    return checkpoint_dir(run_dir) / tag


def saved_by(run_dir: str | os.PathLike, launch_id: str) -> bool:
    """Whether the newest checkpoint was saved by launch `launch_id`. A worker group that Ray
    Train restarted within one launch resumes from such a checkpoint even without --resume
    (the launch's own progress); an older launch's checkpoint is used only with --resume."""
    path = Path(run_dir) / "trainer_state.json"
    try:
        return json.loads(path.read_text()).get("launch_id") == launch_id
    except FileNotFoundError:
        return False


def load(deepspeed: Any, run_dir: str | os.PathLike) -> TrainState:
    """Load the newest checkpoint into `deepspeed` (model, optimizer, scheduler)."""
    path, client_state = deepspeed.load_checkpoint(str(checkpoint_dir(run_dir)))
    if path is None:
        raise FileNotFoundError(f"no checkpoint to resume from in {checkpoint_dir(run_dir)}")
    return TrainState(
        step=int(client_state["step"]), data_position=int(client_state["data_position"])
    )


def export_hf(
    module: torch.nn.Module,
    source_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    zero_stage: int,
    rank: int,
) -> Path | None:
    """Write the whole model as a Hugging Face checkpoint (rank 0), with the source
    checkpoint's tokenizer / processor / template files, so `areno serve` loads it."""
    out = Path(out_dir)
    params = list(module.parameters())
    with gathered(params, zero_stage):
        if rank != 0:
            return None
        if out.exists():
            shutil.rmtree(out)
        state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        module.save_pretrained(str(out), state_dict=state)
    for item in Path(source_path).iterdir():
        if _is_weight_file(item.name):
            continue
        if item.is_file() and not (out / item.name).exists():
            shutil.copy2(item, out / item.name)
    return out


def _is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json")
