"""Sibling projections of one input as one matmul: a layer's query / key / value projections, an
MLP's gate and up projections, a gated-delta-net's four input projections.

At 64 decoding rows every projection is a matrix-vector-like product that reads its weight once,
and a small one spends more time starting than streaming. On an H200 (bf16, 64 rows) the
Qwen3-1.7B shape's q, k and v took 15.2 us as three matmuls and 5.8 us as one; gate and up 19.3
and 15.8; the Qwen3.5-2B shape's four gated-delta-net input projections 21.6 and 8.8.

The siblings' weights become views of one fused weight, so memory does not grow and a weight
update copied in place into any sibling (`Worker.load_weights`, CUDA IPC) is seen by the fused
matmul (a parameter replaced rather than written, as `module.to` does, would not be). Inside
`with fused:`, the first sibling of a group computes all of the group's outputs
from its input, and each later sibling called on that same tensor takes its slice; a sibling
called on another input (or first) computes its own, so a model that calls them in another order
or skips one stays correct. Outside the block every module runs its own code.
"""

from __future__ import annotations

import threading
import types
import weakref

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from areno.engine.layers.switch import Switch

# Siblings fused, in the order the model code calls them.
GROUPS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("in_proj_qkv", "in_proj_b", "in_proj_a", "in_proj_z"),
)


class _Group:
    """One set of sibling projections over a fused weight (and bias)."""

    def __init__(self, names: tuple[str, ...], linears: list[torch.nn.Linear]):
        self.names = names
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        # NOTE: Parameters (unregistered, without grad), as the siblings' were: torch.compile
        # keeps a parameter's sizes static under dynamic=True, where a plain tensor reached
        # through a closure may be given symbolic ones.
        with torch.no_grad():
            self.weight = _parameter(torch.cat([m.weight for m in linears]))
            self.bias = None
            if linears[0].bias is not None:
                self.bias = _parameter(torch.cat([m.bias for m in linears]))
        self.input: torch.Tensor | None = None
        self.outputs: list[torch.Tensor] | None = None
        # A norm (weight, eps, offset) the next product applies to its input first, set for
        # one call by a decoder layer that folds its input norm in (row_layer.py).
        self.norm: tuple[torch.Tensor, float, float] | None = None
        # The fused matmul, x -> x @ weight.T + bias; the CPU's packed layers swap in their own
        # while active (areno/engine/layers/cpu_linear.py).
        self.linear = self.plain_linear
        # Each sibling's parameters become views of its rows of the fused tensors.
        start = 0
        for m, size in zip(linears, self.sizes, strict=True):
            m.weight.data = self.weight[start : start + size]
            if self.bias is not None:
                m.bias.data = self.bias[start : start + size]
            start += size

    def plain_linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward(self, index: int, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if index == 0:
            out = self.linear(x)
            self.input, self.outputs = x, list(out.split(self.sizes, dim=-1))
            return self.outputs[0]
        if self.input is x and self.outputs is not None:
            out = self.outputs[index]
            if index == len(self.linears) - 1:
                self.input = self.outputs = None
            return out
        return F.linear(x, module.weight, module.bias)

    def release(self) -> None:
        self.input = self.outputs = None


def _parameter(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=False)


def _fusable(linears: list) -> bool:
    first = linears[0]
    return all(
        type(m) is torch.nn.Linear
        and not isinstance(m.weight, DTensor)
        and m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        for m in linears
    )


# One FusedLinears per text stack: fusing a stack again would concatenate the views of the first
# fused weights into new ones and leave the first FusedLinears' matmuls on stale weights.
_FUSED: weakref.WeakKeyDictionary[torch.nn.Module, FusedLinears] = weakref.WeakKeyDictionary()
_FUSED_LOCK = threading.Lock()


class FusedLinears(Switch):
    """The fused sibling projections of one model's text stack; active only inside `with`.

    Build it with `FusedLinears.of(text_stack)`, which hands every runner over one model the same
    instance; its `with` blocks nest (the fused path stays on until the outermost one exits).
    """

    @classmethod
    def of(cls, text_stack: torch.nn.Module) -> FusedLinears:
        with _FUSED_LOCK:
            fused = _FUSED.get(text_stack)
            if fused is None:
                fused = _FUSED[text_stack] = cls(text_stack)
            return fused

    def __init__(self, text_stack: torch.nn.Module):
        super().__init__()
        self.groups: list[_Group] = []
        for parent in text_stack.modules():
            for names in GROUPS:
                linears = [getattr(parent, name, None) for name in names]
                if any(m is None for m in linears) or not _fusable(linears):
                    continue
                group = _Group(names, linears)
                for index, m in enumerate(linears):
                    m.forward = types.MethodType(self._forward(group, index, m.forward), m)
                self.groups.append(group)

    def _forward(self, group: _Group, index: int, original):
        def forward(module, x):
            if not self.active:
                return original(x)
            return group.forward(index, module, x)

        return forward

    def switched_off(self) -> None:
        for group in self.groups:
            group.release()
