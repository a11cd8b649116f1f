"""Host-to-device copies that do not wait for the device.

A plain copy from pageable host memory to a CUDA tensor synchronizes the stream: it returns only
after every kernel queued before it has run. In an overlapped engine step (areno/engine/core/engine_core.py)
that would wait for the step just launched, so the copies on the step's path go through pinned
memory, without blocking.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` on `device`: on CUDA through pinned memory and a non-blocking copy (the pinned
    buffer is kept until the copy has run), elsewhere a plain `to`."""
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
