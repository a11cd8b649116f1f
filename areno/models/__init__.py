"""Checkpoint families: adapters keyed by config.model_type, and tiny checkpoints for tests."""

from areno.models import families as _families  # noqa: F401  (registers the adapters)
from areno.models.registry import (
    FamilyAdapter,
    adapter_for_checkpoint,
    get_adapter,
    read_model_type,
    register,
    supported_model_types,
)

__all__ = [
    "FamilyAdapter",
    "adapter_for_checkpoint",
    "get_adapter",
    "read_model_type",
    "register",
    "supported_model_types",
]
