"""Linear layers on CPU through oneDNN, with each weight packed once into oneDNN's blocked layout.

A decode step's matmuls have one row per running request. For those skinny shapes aten's mm
reads the weight in its plain layout every call; oneDNN with the weight reordered ahead of time
ran them 1.8-2x faster on this project's 2-core machine (16 x 512 @ 512 x 2048: 0.39 vs 0.71 ms),
and prefill-sized ones 1.1-1.4x. This is what torch.compile's CPU "freezing" does, without
compiling. `benchmarks/engine_throughput.py --workload cpu --cpu-linear aten packed` shows the
whole engine both ways.

Like the engine's kernels (areno/engine/attention.py, linear_attention.py), the packed layers are
in force only inside the engine's forwards (`with linears:`); outside, the model is transformers'
own. The packed tensors are copies derived from the weights, so whoever changes a weight must
`repack` it (`Worker.load_weights` does). They double the memory of the packed layers.

Traced by torch.compile, a packed layer calls oneDNN through the custom op `areno::packed_linear`,
so a compiled decode step keeps the packed matmuls: inductor's own lowering of oneDNN's linear
takes only weights it froze into constants, which in-place weight updates rule out, and without
it a compiled step runs aten's matmul on the plain weights. Eagerly it calls oneDNN directly
(on 2 cores, 16 x 512 @ 512 x 2048 took 231-270 us directly and 285-302 through the op).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# Rows the packing is tuned for (oneDNN takes any row count at run time): a decode step's batch.
ROWS_HINT = 16


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
    those layers through them."""

    def __init__(self, model: nn.Module):
        self._layers: list[nn.Linear] = []
        for module in model.modules():
            # Subclasses (quantized, LoRA) and DTensor shards keep their own forward.
            if type(module) is not nn.Linear or type(module.weight) is not nn.Parameter:
                continue
            if module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
                self._layers.append(module)
        self._packed: dict[nn.Linear, torch.Tensor] = {}
        self.repack(layer.weight for layer in self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def repack(self, weights: Iterable[torch.Tensor]) -> None:
        """Pack again the layers whose weight is one of these parameters (after they were
        written). By identity, not name: a tied lm_head has no name of its own."""
        written = {id(w) for w in weights}
        for layer in self._layers:
            if id(layer.weight) in written:
                self._packed[layer] = torch.ops.mkldnn._reorder_linear_weight(
                    layer.weight.detach(), ROWS_HINT
                )

    def __enter__(self) -> PackedLinears:
        for layer in self._layers:
            layer.forward = _packed_forward(layer, self._packed[layer])
        return self

    def __exit__(self, *exc) -> None:
        for layer in self._layers:
            vars(layer).pop("forward", None)


def _packed_forward(layer: nn.Linear, packed: torch.Tensor):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, packed, layer.bias)
        # Eagerly, oneDNN directly: the custom op's Python dispatch costs a few us a call.
        return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")

    return forward


@torch.library.custom_op("areno::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias, W packed by `torch.ops.mkldnn._reorder_linear_weight` (which keeps W's
    sizes: its tensor is W's shape over oneDNN's blocked layout)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x, packed, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))
