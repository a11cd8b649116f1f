"""Tiny random checkpoints of every supported family, built offline.

`build_tiny(family, out_dir)` writes a checkpoint directory that the Auto classes reload: a
tokenizer trained locally with the family's special tokens, a chat template written for AReno
(with tool support), the family's real processor configs and random weights (~0.3 M parameters).
Real checkpoints go through exactly the same code paths. `size="small"` scales the text model to
~30 M parameters (same tokenizer, processor and template) for CPU benchmarks, where compute rather
than Python overhead must dominate; `size="2b"` builds the text stacks of the ~2B checkpoints
(Qwen3.5-2B, a Gemma 4 E2B-like one; ~1.0-1.4 B parameters with the tiny vocabulary) in bf16, for
GPU runs.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from areno.errors import ConfigError

if TYPE_CHECKING:
    from areno.models.tiny.common import TinyParts

# NOTE: the names import nothing heavy: the CLI builds its parser from them, and `areno serve
# --model-path` reaches Ray without torch or transformers (2.3 s on 2 CPU cores). The builders
# load those when a checkpoint is built (`builders`).
TINY_FAMILIES = ("qwen3_5", "gemma4", "minicpmv4_6", "qwen3_vl")
TINY_SIZES = ("tiny", "small", "2b")  # every builder knows each of these text-model shapes
# Sizes saved in bfloat16 (GPU runs; half the disk and load time), the others in float32.
_BF16_SIZES = ("2b",)
DEFAULT_FAMILY = "gemma4"  # the one family that takes all three modalities
# Bump when a builder changes, so cached checkpoints are rebuilt.
TINY_VERSION = 1


def builders() -> dict[str, Callable[[str], TinyParts]]:
    """Each family's builder of its parts at a text-model size."""
    from areno.models.tiny.gemma4 import build_gemma4
    from areno.models.tiny.minicpmv import build_minicpmv4_6
    from areno.models.tiny.qwen import build_qwen3_5, build_qwen3_vl

    found = {
        "qwen3_5": build_qwen3_5,
        "gemma4": build_gemma4,
        "minicpmv4_6": build_minicpmv4_6,
        "qwen3_vl": build_qwen3_vl,
    }
    assert tuple(found) == TINY_FAMILIES
    return found


def build_tiny(
    family: str, out_dir: str | os.PathLike, *, seed: int = 0, size: str = "tiny"
) -> Path:
    """Build a random checkpoint of `family` with a `size` text model into `out_dir`."""
    import torch

    from areno.models.tiny.common import save_tiny

    if family not in TINY_FAMILIES:
        raise ConfigError(
            f"no tiny checkpoint builder for family {family!r}; choose one of {list(TINY_FAMILIES)}"
        )
    check_size(size)
    torch.manual_seed(seed)
    parts = builders()[family](size)
    if size in _BF16_SIZES:
        parts.model.to(torch.bfloat16)
    return save_tiny(parts, Path(out_dir))


def check_size(size: str) -> None:
    """Raise ConfigError unless `size` is one of TINY_SIZES."""
    if size not in TINY_SIZES:
        raise ConfigError(
            f"unknown tiny checkpoint size {size!r}; choose one of {list(TINY_SIZES)} "
            f"(tiny: ~0.3 M parameters, small: ~30 M, 2b: ~1.4 B in the text model)"
        )


def cache_dir() -> Path:
    root = os.environ.get("ARENO_CACHE_DIR") or Path.home() / ".cache" / "areno"
    return Path(root) / "tiny"


def tiny_checkpoint(family: str = DEFAULT_FAMILY, size: str = "tiny") -> Path:
    """The cached checkpoint of `family` and `size`, built on first use (the embedded default)."""
    check_size(size)
    # NOTE: "tiny" keeps the original directory name, so caches built before sizes existed hold.
    name = family if size == "tiny" else f"{family}-{size}"
    path = cache_dir() / f"{name}-v{TINY_VERSION}"
    if not (path / "config.json").exists():
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        build_tiny(family, tmp, size=size)
        if path.exists():  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.rename(path)
    return path
