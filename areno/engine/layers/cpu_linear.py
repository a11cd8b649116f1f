"""Linear layers on CPU through oneDNN, with each weight packed once into oneDNN's blocked layout.

A decode step's matmuls have one row per running request. For those skinny shapes aten's mm
reads the weight in its plain layout every call; oneDNN with the weight reordered ahead of time
ran them 1.8-2x faster on this project's 2-core machine (16 x 512 @ 512 x 2048: 0.39 vs 0.71 ms),
and prefill-sized ones 1.1-1.4x. This is what torch.compile's CPU "freezing" does, without
compiling. `benchmarks/engine_throughput.py --workload cpu --cpu-linear aten packed` shows the
whole engine both ways.

Like the engine's kernels (areno/engine/layers/attention.py, linear_attention.py), the packed layers are
in force only inside the engine's forwards (`with linears:`); outside, the model is transformers'
own. The packed tensors are copies derived from the weights, so whoever changes a weight must
`repack` it (`Worker.load_weights` does). They double the memory of the packed layers.

With the model's projections fused (`fuse_projections`, areno/engine/layers/fused_linear.py), each
fused group's weight is packed whole and the group's one matmul runs packed; a weight update to
any sibling repacks its group.

Traced by torch.compile, a packed layer calls oneDNN through the custom op `areno::packed_linear`,
so a compiled decode step keeps the packed matmuls: inductor's own lowering of oneDNN's linear
takes only weights it froze into constants, which in-place weight updates rule out, and without
it a compiled step runs aten's matmul on the plain weights. Eagerly it calls oneDNN directly
(on 2 cores, 16 x 512 @ 512 x 2048 took 231-270 us directly and 285-302 through the op as it
was first defined). The op names its packed weight by two integers (its `PackedLinears` and the
weight's index there) rather than taking the tensor: a traced graph holding oneDNN tensors as
constants cannot be pickled, so Inductor's and AOTAutograd's caches passed it by and a second
start compiled it all again (areno/engine/compile_cache.py).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from areno.engine.layers.fused_linear import FusedLinears

# Rows the packing is tuned for (oneDNN takes any row count at run time): a decode step's batch.
ROWS_HINT = 16

# Every live PackedLinears of the process by its number, for the compiled op's lookups. Numbered
# in creation order, so a process's first engine traces the same graph on every start.
_OWNERS: weakref.WeakValueDictionary[int, PackedLinears] = weakref.WeakValueDictionary()
_owner_numbers = itertools.count()


def can_pack(model: nn.Module) -> bool:
    """Whether `model` runs on CPU in float32 with oneDNN available (the packed path's domain)."""
    param = next(model.parameters())
    return (
        param.device.type == "cpu"
        and param.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


class PackedLinears:
    """oneDNN-packed copies of a model's plain `nn.Linear` weights; a context manager that routes
    those layers through them. Given the model's `FusedLinears`, each fused group's weight is
    packed whole and its matmul runs on that (its siblings are left to the group)."""

    def __init__(self, model: nn.Module, fused: FusedLinears | None = None):
        self._groups = [g for g in fused.groups if _packable(g.weight)] if fused else []
        grouped = {id(m) for g in self._groups for m in g.linears}
        self._layers: list[nn.Linear] = []
        for module in model.modules():
            # Subclasses (quantized, LoRA) and DTensor shards keep their own forward.
            if type(module) is not nn.Linear or type(module.weight) is not nn.Parameter:
                continue
            if _packable(module.weight) and id(module) not in grouped:
                self._layers.append(module)
        self._targets: list[object] = [*self._layers, *self._groups]  # the op's index into it
        self._packed: dict[object, torch.Tensor] = {}  # a layer or a group -> its packed weight
        self.repack([layer.weight for layer in self._layers] + [g.weight for g in self._groups])
        self.number = next(_owner_numbers)
        _OWNERS[self.number] = self

    def __len__(self) -> int:
        """The matmuls that run packed: one per layer, one per fused group."""
        return len(self._layers) + len(self._groups)

    def repack(self, weights: Iterable[torch.Tensor]) -> None:
        """Pack again the layers whose weight is one of these parameters (after they were
        written), and the fused groups holding one. By identity, not name: a tied lm_head has
        no name of its own."""
        written = {id(w) for w in weights}
        for layer in self._layers:
            if id(layer.weight) in written:
                self._packed[layer] = _pack(layer.weight)
        for group in self._groups:
            if id(group.weight) in written or any(id(m.weight) in written for m in group.linears):
                self._packed[group] = _pack(group.weight)

    def packed(self, index: int) -> torch.Tensor:
        """The packed weight of layer or group `index` (layers first, in module order)."""
        return self._packed[self._targets[index]]

    def __enter__(self) -> PackedLinears:
        for index, layer in enumerate(self._layers):
            layer.forward = self._matmul(index, layer.bias)
        for index, group in enumerate(self._groups, start=len(self._layers)):
            group.linear = self._matmul(index, group.bias)
        return self

    def _matmul(self, index: int, bias: torch.Tensor | None):
        packed = self._packed[self._targets[index]]
        number, out_features = self.number, packed.shape[0]

        def forward(x: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_compiling():
                return packed_linear(x, number, index, out_features, bias)
            # Eagerly, oneDNN directly: the op's dispatch costs a few us a call.
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

        return forward

    def __exit__(self, *exc) -> None:
        for layer in self._layers:
            vars(layer).pop("forward", None)
        for group in self._groups:
            group.linear = group.plain_linear


def _packable(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu"


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def _packed_linear(
    x: torch.Tensor, owner: int, index: int, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ W.T + bias, W the packed weight `index` of PackedLinears number `owner` (packed by
    `torch.ops.mkldnn._reorder_linear_weight`, which keeps W's sizes)."""
    packed = _OWNERS[owner].packed(index)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# NOTE: defined through `torch.library.Library` rather than `torch.library.custom_op`, whose
# Python wrapper costs more a call: in a compiled decode step of the small checkpoint on 2 cores
# the op's 63 calls took 0.8-1.0 ms of self time against 1.8-2.0 as a custom_op
# (`benchmarks/profile_decode.py --model small --graphs static --compile inductor`).
_LIBRARY = torch.library.Library("areno", "FRAGMENT")
_LIBRARY.define(
    "packed_linear(Tensor x, int owner, int index, int out_features, Tensor? bias) -> Tensor"
)
_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("areno::packed_linear")
def _(x, owner, index, out_features, bias):
    return x.new_empty((*x.shape[:-1], out_features))


packed_linear = torch.ops.areno.packed_linear.default
