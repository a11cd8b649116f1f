"""Tiny random checkpoints of every supported family, built offline.

`build_tiny(family, out_dir)` writes a checkpoint directory that the Auto classes reload: a
tokenizer trained locally with the family's special tokens, a chat template written for AReno
(with tool support), the family's real processor configs and random weights (~0.3 M parameters).
Real checkpoints go through exactly the same code paths.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from areno.errors import ConfigError
from areno.models.tiny.common import TinyParts, save_tiny
from areno.models.tiny.gemma4 import build_gemma4
from areno.models.tiny.minicpmv import build_minicpmv4_6
from areno.models.tiny.qwen import build_qwen3_5, build_qwen3_vl

BUILDERS: dict[str, Callable[[], TinyParts]] = {
    "qwen3_5": build_qwen3_5,
    "gemma4": build_gemma4,
    "minicpmv4_6": build_minicpmv4_6,
    "qwen3_vl": build_qwen3_vl,
}
TINY_FAMILIES = tuple(BUILDERS)
DEFAULT_FAMILY = "gemma4"  # the one family that takes all three modalities
# Bump when a builder changes, so cached checkpoints are rebuilt.
TINY_VERSION = 1


def build_tiny(family: str, out_dir: str | os.PathLike, *, seed: int = 0) -> Path:
    """Build a tiny random checkpoint of `family` into `out_dir` and return the path."""
    if family not in BUILDERS:
        raise ConfigError(
            f"no tiny checkpoint builder for family {family!r}; choose one of {list(TINY_FAMILIES)}"
        )
    torch.manual_seed(seed)
    return save_tiny(BUILDERS[family](), Path(out_dir))


def cache_dir() -> Path:
    root = os.environ.get("ARENO_CACHE_DIR") or Path.home() / ".cache" / "areno"
    return Path(root) / "tiny"


def tiny_checkpoint(family: str = DEFAULT_FAMILY) -> Path:
    """The cached tiny checkpoint of `family`, built on first use (the embedded default model)."""
    path = cache_dir() / f"{family}-v{TINY_VERSION}"
    if not (path / "config.json").exists():
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        build_tiny(family, tmp)
        if path.exists():  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.rename(path)
    return path
