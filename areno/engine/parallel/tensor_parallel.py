"""Tensor parallelism for the engine: process groups and sharded model loading.

Every rank runs the same `ModelRunner` over its shard of the weights; transformers' TP plans (via
`DistributedConfig`) insert the collectives, so the runner and the slot cache need no changes
(each rank caches its own share of the KV heads). Rank 0 decides each step and sends it to the
other ranks as a small Python message over the gloo control group, which also works when the
default group is NCCL (`dist.broadcast_object_list` over NCCL would need GPU tensors).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from areno.errors import ConfigError
from areno.models.registry import FamilyAdapter

_control_group: dist.ProcessGroup | None = None
_nccl_groups_started = 0  # NCCL default groups this process has started (see init_distributed)


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: str,
    *,
    bind_device: bool = True,
) -> None:
    """Join the default process group (gloo on CPU, NCCL on CUDA) and create the control group.

    Call once per worker process before `load_model_for_rank`. `bind_device` binds an NCCL group
    to this rank's GPU up front, as transformers does (barrier() and DeviceMesh then use it
    without guessing); every rank of a group must pass the same value, `can_bind_device()` of
    rank 0's process.
    """
    global _control_group, _nccl_groups_started
    dev = torch.device(device)
    if dev.type == "cuda":
        # NCCL's cuMem buffers hung this group's start in cuMemMap on the lent H200s (rank 0 in
        # a process that sees both GPUs, its follower in a Ray actor that sees one); the legacy
        # cudaMalloc path does not. A value the user set wins.
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        index = dev.index if dev.index is not None else 0
        torch.cuda.set_device(index)
        # transformers binds each rank to the GPU numbered LOCAL_RANK when it builds its mesh.
        local_rank = index
    else:
        local_rank = rank
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    dist.init_process_group(
        backend="nccl" if dev.type == "cuda" else "gloo",
        init_method=f"tcp://{host}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=10),
        device_id=torch.device("cuda", local_rank) if dev.type == "cuda" and bind_device else None,
    )
    if dev.type == "cuda":
        _nccl_groups_started += 1
    _control_group = dist.new_group(ranks=list(range(world_size)), backend="gloo")


def can_bind_device() -> bool:
    """Whether a new NCCL group of this process may be bound to its GPU: only the process's first.

    NOTE: DeviceMesh splits a bound group into its subgroups, and torch 2.11's NCCL split
    dereferences null when the default group is not the process's first NCCL group (fixed upstream
    in pytorch#192109): a second TP group in one process (a TP=2 engine after another one) crashed
    there on the lent H200s. Unbound, DeviceMesh makes its subgroups with new_group instead, and a
    split is a collective, so all ranks must agree (the followers are fresh processes).
    """
    return _nccl_groups_started == 0


def control_group() -> dist.ProcessGroup:
    """The gloo group over all ranks, for `dist.broadcast_object_list` of step messages."""
    if _control_group is None:
        raise RuntimeError("init_distributed() has not run in this process")
    return _control_group


def shutdown_distributed() -> None:
    """Leave the process groups. The barrier keeps gloo from aborting a rank still in flight."""
    if dist.is_initialized():
        dist.barrier()
    leave_distributed()


def leave_distributed() -> None:
    """Leave the process groups without waiting for the other ranks (after a failed start)."""
    global _control_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _control_group = None


def tp_plan_for(adapter: FamilyAdapter, tp_size: int) -> str | dict[str, str] | None:
    """The `tp_plan` for `DistributedConfig`: None without TP, "auto" for the model's own plan,
    or the family's overrides of that plan."""
    if tp_size < 1:
        raise ConfigError(f"--tp-size must be at least 1, got {tp_size}", param="tp_size")
    if tp_size == 1:
        return None
    if not adapter.supports_tp:
        raise ConfigError(
            f"{adapter.model_type} checkpoints have no tensor-parallel plan in transformers; "
            "use --tp-size 1",
            param="tp_size",
        )
    return dict(adapter.tp_plan_overrides) or "auto"


def load_model_for_rank(
    adapter: FamilyAdapter,
    model_path: str | os.PathLike,
    *,
    tp_size: int,
    dtype: torch.dtype,
    device: str,
) -> torch.nn.Module:
    """Load the checkpoint for this process: whole on `device` when tp_size is 1, else this
    rank's shard (in a process where `init_distributed` has run over tp_size ranks)."""
    plan = tp_plan_for(adapter, tp_size)
    if plan is None:
        return adapter.load_model(model_path, dtype=dtype).to(device).eval()
    if not dist.is_initialized():
        raise RuntimeError("tensor parallelism needs init_distributed() in this process first")
    if dist.get_world_size() != tp_size:
        raise ConfigError(
            f"--tp-size {tp_size} must equal the number of engine ranks "
            f"({dist.get_world_size()}); tensor parallelism is the only parallelism here",
            param="tp_size",
        )
    from transformers import AutoConfig
    from transformers.distributed import DistributedConfig

    check_head_counts(AutoConfig.from_pretrained(model_path), tp_size)
    model = adapter.load_model(
        model_path,
        dtype=dtype,
        distributed_config=DistributedConfig(tp_size=tp_size, tp_plan=plan),
    )
    # transformers places the shard on the mesh's device: the machine's accelerator (the GPU
    # numbered LOCAL_RANK) when it has one, else the CPU, whatever `device` asked for.
    placed = next(model.parameters()).device
    if placed.type != torch.device(device).type:
        raise ConfigError(
            f"tensor parallelism placed the model on {placed}, not on {device}: transformers "
            "shards onto the machine's accelerator; use a device of that type",
            param="device",
        )
    return model.eval()


def check_head_counts(config, tp_size: int) -> None:
    """Raise ConfigError unless tp_size divides the attention and KV head counts of every part of
    the model that has a TP plan.

    NOTE: colwise q/k/v shards split the flat (heads * head_dim) dimension evenly, so a head
    count that tp_size does not divide leaves a rank holding part of a head, which fails in the
    forward's reshape. (Uneven vocab shards are fine.)
    """
    for part in _tp_planned_configs(config):
        layers = getattr(part, "per_layer_config", None) or [part]
        for layer in layers:
            for key in ("num_attention_heads", "num_key_value_heads"):
                count = getattr(layer, key, None)
                if count and count % tp_size:
                    raise ConfigError(
                        f"--tp-size {tp_size} does not divide {key}={count} of "
                        f"{type(part).__name__}; choose a tp size that divides every head count",
                        param="tp_size",
                    )


def _tp_planned_configs(config) -> list:
    """The config and its sub-configs (recursively) that carry a non-empty base_model_tp_plan."""
    found = [config] if getattr(config, "base_model_tp_plan", None) else []
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if sub is not None:
            found.extend(_tp_planned_configs(sub))
    return found
