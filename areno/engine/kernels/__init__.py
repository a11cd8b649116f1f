"""The engine's Triton kernels, each beside a plain-PyTorch reference of the same arithmetic.

They run on CUDA only, inside the runner's forwards (`EngineAttention`, `EngineKernels`); CPU runs
the references. `tests/engine/test_kernels.py` runs every kernel against its reference, on CPU
through Triton's interpreter and on a GPU for real. `ARENO_TRITON=0` turns them off (benchmarks
compare both ways).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

try:
    import triton
except ImportError:  # a torch build without Triton (CPU-only wheels, macOS)
    triton = None

# Read once at import: inside a compiled step these are constants, not environment lookups.
ENABLED = triton is not None and os.environ.get("ARENO_TRITON", "1") != "0"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels run for `tensor`: on CUDA, or anywhere under Triton's
    interpreter (TRITON_INTERPRET=1, how the kernel tests run them on CPU). Never for a DTensor
    (a tensor-parallel activation that kept its sharding), which the kernels cannot take."""
    return ENABLED and (INTERPRETED or tensor.is_cuda) and not isinstance(tensor, DTensor)


@contextlib.contextmanager
def references_only() -> Iterator[None]:
    """Within the block, the engine runs the PyTorch references instead of the Triton kernels (a
    benchmark's side-by-side rows). Process-wide: the engine thread sees it too."""
    global ENABLED
    enabled, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = enabled
