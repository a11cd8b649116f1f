"""Where torch.compile keeps what it produces, so that a second start of the same model skips the
work: Inductor's graph and kernel caches (its FX graph and AOTAutograd caches, the C++ and
Triton builds) live under a directory AReno owns instead of the temporary directory.

The directory is `<root>/<key>`: the root is `ARENO_COMPILE_CACHE` if set, else
`$XDG_CACHE_HOME/areno/compile` (`~/.cache/areno/compile`); the key names the versions whose
change invalidates the artifacts (Python, torch, Triton, transformers, AReno) and the device kind
(the GPU's name and compute capability). Inside it, Inductor keys each compiled graph by its code,
input shapes and dtypes and its own configuration, so models of different shapes or dtypes share
the directory without sharing entries. Dynamo's traces of the engine's compiled forwards are
kept in its `traces/` folder, under keys of their own (areno/engine/runner/saved_traces.py).
`ARENO_COMPILE_CACHE=off` leaves torch's default (a
directory under the temporary directory); a `TORCHINDUCTOR_CACHE_DIR` the user set is kept, unless
it names torch's default itself: importing torch._dynamo writes that default into the variable,
so it cannot tell a user's choice from torch's.

Set once per process, before the first compile (`Generator.from_config` calls `use`)."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections import Counter
from importlib import metadata
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV = "ARENO_COMPILE_CACHE"
_INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"

# This process's Dynamo traces of compiled forwards: "loaded" from the cache, "traced" (and saved).
traces: Counter[str] = Counter()


def default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "areno" / "compile"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def cache_key(device: torch.device) -> str:
    """A short name for the versions and the device kind compiled artifacts depend on."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        capability = ".".join(map(str, torch.cuda.get_device_capability(index)))
        where = f"cuda-{name}-sm{capability}"
    else:
        where = device.type
    parts = [
        f"py{sys.version_info.major}.{sys.version_info.minor}",
        f"torch{torch.__version__}",
        f"triton{_version('triton')}",
        f"transformers{_version('transformers')}",
        f"areno{_version('areno')}",
        where,
    ]
    digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]
    return f"{device.type}-{digest}"


def use(device: torch.device) -> Path | None:
    """Point Inductor's caches at AReno's directory for `device` (made if missing) and return
    it; None where the user chose otherwise (ARENO_COMPILE_CACHE=off, or their own
    TORCHINDUCTOR_CACHE_DIR). A later call in the same process keeps the first one's choice."""
    chosen = os.environ.get(_INDUCTOR_ENV)
    root = os.environ.get(ENV)
    if root is not None and root.lower() in ("off", "0", "none", ""):
        return None
    if chosen is not None and _ours(Path(chosen)):
        return Path(chosen)
    if chosen is not None and not _torch_default(chosen):
        return None
    path = Path(root or default_root()) / cache_key(device)
    path.mkdir(parents=True, exist_ok=True)
    (path / ".areno").touch()
    os.environ[_INDUCTOR_ENV] = str(path)
    log.info("compile cache: %s", path)
    return path


def current() -> Path | None:
    """The directory `use` chose in this process; None where compiled artifacts are not AReno's
    to keep (no `use` yet, ARENO_COMPILE_CACHE=off, the user's own TORCHINDUCTOR_CACHE_DIR)."""
    chosen = os.environ.get(_INDUCTOR_ENV)
    root = os.environ.get(ENV)
    if root is not None and root.lower() in ("off", "0", "none", ""):
        return None
    if chosen is None or not _ours(Path(chosen)):
        return None
    return Path(chosen)


def _ours(path: Path) -> bool:
    return (path / ".areno").is_file()


def _torch_default(chosen: str) -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR holds torch's own default, which torch writes there when
    it first asks for its cache directory (importing torch._dynamo does): not a user's choice."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(chosen) == os.path.abspath(default_cache_dir())


def num_entries(path: Path | None) -> int:
    """Files in the cache (0 when there is none): how warm a start-up found it."""
    if path is None or not path.is_dir():
        return 0
    return sum(len(files) for _, _, files in os.walk(path))
