"""The text stack's linear layers and the LM head, with a product of one row on the matrix-vector
kernel (areno/engine/kernels/gemv.py): a decode step of one sequence, a lone prompt's logits.

Like the engine's other layers (attention.py, linear_attention.py, cpu_linear.py) they are in
force only inside the engine's forwards (`with linears:`); outside, each layer computes what
`nn.Linear` does. Each call reads its layer's weight then, so a weight written in place or
replaced is what it multiplies. With the model's projections fused (fused_linear.py) each
group's one matmul takes the kernel too. A product of several rows, a layer the kernel does not
take (a DTensor shard, a subclass of nn.Linear) and the whole of a CPU run without Triton's
interpreter keep their own matmul; LoRA's hooks (lora.py) still add the adapters' part to the
output.
"""

from __future__ import annotations

import types
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from areno.engine.kernels.gemv import (
    norm_row_linear,
    norm_row_linear_op,
    row_linear,
    row_linear_op,
)
from areno.engine.layers.fused_linear import FusedLinears
from areno.engine.layers.switch import Switch


class RowLinears(Switch):
    """Routes the plain `nn.Linear` layers among `modules` (those of a fused group through the
    group) to `areno::row_linear` while active. The routing is installed once: entering and
    leaving, which every forward of the runner does, only flips `active`."""

    def __init__(self, modules: Iterable[nn.Module], fused: FusedLinears | None = None):
        self._groups = list(fused.groups) if fused else []
        grouped = {id(m) for g in self._groups for m in g.linears}
        self._layers = [
            m
            for m in dict.fromkeys(modules)
            if type(m) is nn.Linear and type(m.weight) is nn.Parameter and id(m) not in grouped
        ]
        super().__init__()
        # NOTE: bound methods, which pickle by name: Dynamo's saved guards pickle what the traced
        # forward reaches, and a closure would take this object with it, lock and all (every
        # trace of a GPU engine failed to save: "cannot pickle '_thread.lock' object").
        for layer in self._layers:
            layer.forward = types.MethodType(self._routed("forward"), layer)
        for group in self._groups:
            group.linear = types.MethodType(self._routed("linear"), group)

    def __len__(self) -> int:
        """The matmuls it routes: one per layer, one per fused group."""
        return len(self._layers) + len(self._groups)

    def _routed(self, name: str):
        """The product of the object it is bound to (an nn.Linear or a fused group: each has
        `weight` and `bias`), as its attribute `name`."""

        def forward(owner, x: torch.Tensor) -> torch.Tensor:
            if not self.active:
                return F.linear(x, owner.weight, owner.bias)
            norm = getattr(owner, "norm", None)
            if norm is not None:  # a fused group given its layer's input norm, for this call
                owner.norm = None
                if torch.compiler.is_compiling():
                    return norm_row_linear_op(x, *norm, owner.weight)
                return norm_row_linear(x, *norm, owner.weight)
            if torch.compiler.is_compiling():
                # Traced, the op only where the graph has one row for certain (torch.compile
                # specializes a size of 1): a graph of several rows keeps inductor's own
                # matmul, without the op's call into Python at every run (a batched prefill is
                # not captured).
                if statically_known_true(x.numel() == x.shape[-1]):
                    return row_linear_op(x, owner.weight, owner.bias)
                return F.linear(x, owner.weight, owner.bias)
            # Eagerly, the function itself: the op's dispatch costs a few us a call.
            return row_linear(x, owner.weight, owner.bias)

        forward.__name__ = name
        return forward
