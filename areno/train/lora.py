"""LoRA training: `peft` adapters on the language model's linear layers, never the towers.

`lora.rank` > 0 wraps the policy in a PEFT model whose only trainable parameters are the
adapters' factors; the weight sync then sends those alone (`policy_adapter`, which the
generator loads beside its base weights: areno/engine/layers/lora.py), and the run exports a PEFT
adapter directory (`export_adapter`) that `peft` loads on top of the base checkpoint and
`areno serve --lora NAME=PATH` serves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from areno.engine.layers.lora import LoraWeights, adapter_scaling
from areno.errors import ConfigError
from areno.settings import setting

# What PEFT puts before the wrapped model's own module paths.
PEFT_PREFIX = "base_model.model."


@dataclass
class LoraConfig:
    """`lora:` of a GRPO or SFT config. rank 0: full-parameter training."""

    rank: int = setting(0, help="the adapters' rank; 0: full-parameter training")
    alpha: float = setting(16.0, help="LoRA's alpha (the update is scaled by alpha / rank)")
    dropout: float = setting(0.0, help="dropout on the adapters' input")
    target_modules: list[str] | None = setting(
        None,
        help="last names of the language model's linear layers to adapt (q_proj, down_proj, "
        "...); none: every linear layer of the language model (attention, MLP, linear "
        "attention)",
    )

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(f"lora.rank must be an integer >= 0 (0: off); got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float):
            raise ConfigError(f"lora.alpha must be a number; got {self.alpha!r}")
        if not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout must be in [0, 1); got {self.dropout!r}")
        names = self.target_modules
        if names is not None and (
            not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names)
        ):
            raise ConfigError(
                f"lora.target_modules must be a non-empty list of names; got {names!r}"
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def lora_targets(model: torch.nn.Module, modules: list[str] | None = None) -> list[str]:
    """The module paths of the language model's linear layers to adapt: all of them, or those
    whose last name is in `modules` (a name that matches none is an error)."""
    stack = {id(m) for m in model.get_decoder().modules()}
    linears = [
        name
        for name, module in model.named_modules()
        if id(module) in stack and isinstance(module, torch.nn.Linear)
    ]
    if modules is None:
        return linears
    chosen = [name for name in linears if name.rsplit(".", 1)[-1] in modules]
    found = {name.rsplit(".", 1)[-1] for name in chosen}
    missing = [m for m in modules if m not in found]
    if missing:
        known = sorted({name.rsplit(".", 1)[-1] for name in linears})
        raise ConfigError(
            f"lora.target_modules {missing} name no linear layer of the language model; "
            f"its linear layers are {known}"
        )
    return chosen


def apply_lora(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """`model` wrapped in a PEFT LoRA model: the adapters train, every base weight is frozen."""
    import peft

    peft_config = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=lora_targets(model, config.target_modules),
    )
    return peft.get_peft_model(model, peft_config)


def is_lora(module: torch.nn.Module) -> bool:
    return hasattr(module, "peft_config")


def base_model(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT model (`module` itself otherwise)."""
    return module.get_base_model() if is_lora(module) else module


def policy_adapter(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> LoraWeights:
    """A PEFT policy's adapter factors `tensors` (its trainable parameters by name), with the
    scaling its config gives them, as the generator loads them."""
    config = module.peft_config["default"].to_dict()
    return LoraWeights.from_tensors(tensors, adapter_scaling(config, "the policy's LoRA config"))


def export_adapter(
    module: torch.nn.Module, base_path: str | os.PathLike, out_dir: str | os.PathLike
) -> Path:
    """Write a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`)
    whose base is `base_path`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    module.peft_config["default"].base_model_name_or_path = str(Path(base_path).resolve())
    module.save_pretrained(str(out))
    return out
