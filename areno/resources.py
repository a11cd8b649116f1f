"""Custom Ray resources in configs: how a user places a deployment or a worker on chosen nodes.

A node advertises custom resources when Ray starts on it (`ray start --resources='{"rollout":
8}'`, or a node type's `resources` in a cluster YAML); an actor that asks for an amount of one
only runs on a node that has it left. CPU and GPU are not custom resources: they have their own
fields (num_cpus_*, num_gpus_*, device).
"""

from __future__ import annotations

from typing import Any

from areno.errors import ConfigError


def check_custom_resources(value: Any, where: str) -> dict[str, float]:
    """`value` as {resource name: amount >= 0}; a ConfigError naming `where` otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(
            f'{where} must map resource names to amounts, e.g. {{"rollout": 1}}; got {value!r}',
            param=where,
        )
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: resource names are strings; got {name!r}", param=where)
        if name in ("CPU", "GPU"):
            raise ConfigError(
                f"{where}: {name} is not a custom resource; set it with its own num_cpus / "
                f"num_gpus field",
                param=where,
            )
        if isinstance(amount, bool) or not isinstance(amount, int | float) or amount < 0:
            raise ConfigError(f"{where}.{name} must be a number >= 0; got {amount!r}", param=where)
    return dict(value)
