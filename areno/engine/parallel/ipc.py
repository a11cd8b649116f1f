"""Weights passed between processes on one GPU by CUDA IPC handle instead of by value.

A trainer and a generator that share a GPU (fractional Ray GPUs, as in colocated GRPO) need not
copy the weights to host memory and back: the sender shares each parameter's device memory and
the receiver copies it straight into its own parameters, device to device. `CudaIpcWeights` is
the small picklable message (one handle per tensor, a few hundred bytes each) that travels over a
Ray call in place of the tensors; `Generator.update_weights` accepts it like a mapping.

The sender must keep the shared tensors unchanged until every receiver has loaded them: the
trainer waits for `update_weights` to return before its next optimizer step, and
`Worker.load_weights` returns only once its copies have run on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

# NOTE: index of the device ordinal in the args of torch's `rebuild_cuda_tensor`
# (torch/multiprocessing/reductions.py: tensor_cls, size, stride, offset, storage_cls, dtype,
# storage_device, ...). The sender's ordinal is replaced by the receiver's ordinal of the same
# physical GPU, found by UUID, since each Ray actor numbers its visible GPUs from 0.
_DEVICE_ARG = 6


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_gpu_uuids() -> list[str]:
    """UUIDs of the GPUs this process sees, in its own device order (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


@dataclasses.dataclass
class CudaIpcWeights:
    """(name, CUDA tensor) pairs shared by IPC handle; `open()` in another process on the same
    GPU gives tensors that alias the sender's memory."""

    gpu_uuid: str
    handles: list[tuple[str, Any, tuple]]  # (name, rebuild function, its args)

    @classmethod
    def share(cls, named: Iterable[tuple[str, torch.Tensor]]) -> CudaIpcWeights:
        from torch.multiprocessing.reductions import reduce_tensor

        handles, uuid = [], None
        for name, tensor in named:
            if not tensor.is_cuda:
                raise ValueError(f"{name} is on {tensor.device}; only CUDA tensors are shared")
            tensor_uuid = device_uuid(tensor.device.index)
            if uuid not in (None, tensor_uuid):
                raise ValueError("all shared tensors must be on one GPU")
            uuid = tensor_uuid
            rebuild, args = reduce_tensor(tensor.detach())
            handles.append((name, rebuild, args))
        if uuid is None:
            raise ValueError("no tensors to share")
        # The receivers read this memory on their own streams: what wrote it must be done.
        torch.cuda.synchronize()
        return cls(uuid, handles)

    def __len__(self) -> int:
        return len(self.handles)

    def open(self) -> list[tuple[str, torch.Tensor]]:
        """The shared tensors, mapped into this process (which must see the sender's GPU)."""
        uuids = visible_gpu_uuids()
        if self.gpu_uuid not in uuids:
            raise RuntimeError(
                f"weights shared from GPU {self.gpu_uuid} by CUDA IPC, which this process does "
                f"not see (it sees {uuids or 'no GPU'}); send them by value instead"
            )
        index = uuids.index(self.gpu_uuid)
        return [
            (name, rebuild(*args[:_DEVICE_ARG], index, *args[_DEVICE_ARG + 1 :]))
            for name, rebuild, args in self.handles
        ]
