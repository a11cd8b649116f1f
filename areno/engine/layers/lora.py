"""Low-rank adapters (LoRA) beside the engine's linear layers; the base weights never change.

An engine started with `max_loras` S > 0 gives every linear layer of its text stack S adapter
slots of rank up to r (`max_lora_rank`), side by side in two factors: A (in, S*r) and B (S*r,
out), an adapter of smaller rank padded with zeros, its scaling folded into its rows of B. A
forward adds `((x @ A) * M) @ B` to each such layer's output, where M (rows, 1, S*r) holds ones
on the columns of each row's adapter (none for a row on the base model). One shape for every mix
of adapters in a batch: a decode step's CUDA graph is captured once and serves them all, and
loading an adapter writes its factors in place, between two steps.

Adapters arrive in PEFT's layout (`LoraWeights`): from an adapter directory
(`adapter_config.json` + `adapter_model.safetensors`, what `peft` saves) or from a trainer's
PEFT model (the GRPO weight sync sends only these tensors).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from areno.engine.transfer import to_device
from areno.errors import ArenoError

ADAPTER_CONFIG = "adapter_config.json"
# The name an RL weight sync loads a LoRA policy under (the engine's default adapter then).
POLICY_ADAPTER = "policy"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# A PEFT tensor name: "[base_model.model.]<module>.lora_A[.<adapter>].weight".
_PEFT_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<factor>[AB])(?:\.[^.]+)?\.weight$"
)


class LoraError(ArenoError):
    """An adapter that does not fit the engine (rank, modules, shapes) or is not loaded."""

    code = "lora_mismatch"


@dataclass
class LoraWeights:
    """One adapter: per adapted module (the model's own module path), A (rank, in) and B (out,
    rank) as PEFT stores them, and the scaling of B @ A (alpha / rank, or alpha / sqrt(rank)
    for rank-stabilised LoRA)."""

    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float

    @property
    def rank(self) -> int:
        return max((a.shape[0] for a, _ in self.factors.values()), default=0)

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], scaling: float) -> LoraWeights:
        """From PEFT-named tensors (a saved adapter's, or a live PEFT model's parameters)."""
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            match = _PEFT_NAME.match(name)
            if match is None:
                raise LoraError(f"{name!r} is not a LoRA factor (…lora_A.weight / lora_B.weight)")
            halves.setdefault(match["module"], {})[match["factor"]] = tensor
        factors = {}
        for module, pair in halves.items():
            if set(pair) != {"A", "B"}:
                raise LoraError(f"module {module!r} has lora_{'A' if 'B' in pair else 'B'} only")
            a, b = pair["A"], pair["B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                raise LoraError(
                    f"module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                    "are not (rank, in) and (out, rank)"
                )
            factors[module] = (a, b)
        return cls(factors, scaling)

    @classmethod
    def from_dir(cls, path: str | Path) -> LoraWeights:
        """A PEFT adapter directory (`peft`'s `save_pretrained`)."""
        from safetensors.torch import load_file

        path = Path(path)
        config_file, weights_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
        for file in (config_file, weights_file):
            if not file.is_file():
                raise LoraError(f"{path} is not a PEFT adapter directory: {file.name} is missing")
        config = json.loads(config_file.read_text())
        return cls.from_tensors(load_file(str(weights_file)), adapter_scaling(config, path))


def adapter_scaling(config: dict, where: object) -> float:
    """The scaling a PEFT LoRA config gives B @ A; refuses what the engine does not apply."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoraError(f"{where}: per-module ranks or alphas ({key}) are not supported")
    for key in ("use_dora", "modules_to_save"):
        if config.get(key):
            raise LoraError(f"{where}: {key} is not supported (plain LoRA factors only)")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


class _Layer:
    """The adapter factors of one linear layer, every slot side by side."""

    def __init__(self, linear: torch.nn.Linear, width: int):
        weight = linear.weight
        self.a = torch.zeros(linear.in_features, width, dtype=weight.dtype, device=weight.device)
        self.b = torch.zeros(width, linear.out_features, dtype=weight.dtype, device=weight.device)


class LoraLayers:
    """`max_adapters` adapter slots of rank up to `max_rank` beside every linear layer of
    `text_stack`; the runner says which adapter each row of a forward runs with (`set_rows`).
    Active only inside `with` (the runner's forwards): the model's own forwards elsewhere (a
    trainer's, a reference's) never see the adapters. `release()` removes them."""

    def __init__(
        self,
        model: torch.nn.Module,
        text_stack: torch.nn.Module,
        *,
        max_adapters: int,
        max_rank: int,
        max_rows: int,
    ):
        self.max_adapters, self.max_rank = max_adapters, max_rank
        width = max_adapters * max_rank
        stack_ids = {id(m) for m in text_stack.modules()}
        self.layers: dict[str, _Layer] = {}
        self._hooks = []
        self._depth = 0
        for name, module in model.named_modules():
            if id(module) in stack_ids and isinstance(module, torch.nn.Linear):
                layer = self.layers[name] = _Layer(module, width)
                self._hooks.append(module.register_forward_hook(self._hook(layer)))
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        # Column c belongs to adapter index 1 + c // max_rank (0 is the base model).
        self._owner = 1 + torch.arange(width, device=device) // max_rank
        self.mask = torch.zeros(max_rows, 1, width, dtype=dtype, device=device)
        self.index: dict[str, int] = {}  # adapter name -> its index (1..max_adapters)

    def _hook(self, layer: _Layer):
        def add_adapters(module, args, output):
            if not self._depth:
                return output
            x = args[0]  # (rows, tokens, in), or (rows, in) in a decode step's own kernels
            mask = self.mask[: x.shape[0]]
            if x.dim() == 2:
                mask = mask[:, 0]
            return output + ((x @ layer.a) * mask) @ layer.b

        return add_adapters

    def __enter__(self) -> LoraLayers:
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1

    def release(self) -> None:
        """Take the adapters off the model's layers for good."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.layers = {}

    def load(self, name: str, weights: LoraWeights) -> int:
        """Write adapter `name`'s factors into its slot (a new one, or the slot it has: an
        update in place); returns its index. Nothing is written unless all of it fits."""
        index = self.index.get(name)
        if index is None:
            if len(self.index) == self.max_adapters:
                raise LoraError(
                    f"adapter {name!r} does not fit: the engine holds at most "
                    f"{self.max_adapters} adapters ({', '.join(self.index)})"
                )
            index = len(self.index) + 1
        self._check(name, weights)
        columns = slice((index - 1) * self.max_rank, index * self.max_rank)
        with torch.no_grad():
            for layer in self.layers.values():
                layer.a[:, columns].zero_()
                layer.b[columns].zero_()
            for module, (a, b) in weights.factors.items():
                layer, rank = self.layers[module], a.shape[0]
                start = columns.start
                layer.a[:, start : start + rank].copy_(a.t())
                layer.b[start : start + rank].copy_(b.t() * weights.scaling)
        self.index[name] = index
        return index

    def _check(self, name: str, weights: LoraWeights) -> None:
        if weights.rank > self.max_rank:
            raise LoraError(
                f"adapter {name!r} has rank {weights.rank}, above the engine's max_lora_rank "
                f"{self.max_rank}"
            )
        for module, (a, b) in weights.factors.items():
            layer = self.layers.get(module)
            if layer is None:
                raise LoraError(
                    f"adapter {name!r} adapts {module!r}, which is not a linear layer of the "
                    "model's language model"
                )
            if a.shape[1] != layer.a.shape[0] or b.shape[0] != layer.b.shape[1]:
                raise LoraError(
                    f"adapter {name!r}: {module!r} takes {layer.a.shape[0]} -> "
                    f"{layer.b.shape[1]} features, the adapter's factors "
                    f"{tuple(a.shape)} and {tuple(b.shape)}"
                )

    def index_of(self, name: str | None) -> int:
        """The index of adapter `name` (None: 0, the base model)."""
        if name is None:
            return 0
        if name not in self.index:
            raise LoraError(f"no adapter named {name!r} is loaded", param="model")
        return self.index[name]

    def set_rows(self, indices: list[int] | torch.Tensor) -> None:
        """Row i of the next forwards runs with adapter `indices[i]`; rows past them (a padded
        graph's) with none."""
        if not isinstance(indices, torch.Tensor):
            indices = to_device(torch.tensor(indices), self._owner.device)
        rows = len(indices)
        self.mask[:rows, 0] = (self._owner[None, :] == indices[:, None]).to(self.mask.dtype)
        self.mask[rows:].zero_()
