"""A decoder layer's MLP half at one row (a decode step of one sequence) in two kernels.

At one row a layer's step is a dozen short kernels, each a few microseconds of launch and tail
for little work (docs/performance.md, "Where a step's time goes"). After the token mixer a
Qwen-style layer runs: the residual add and the norm (one kernel), `gate_up`, the activation
(one kernel), `down`, and leaves its residual add to the next layer's norm. Here
`areno::add_norm_row_linear` adds the residual, normalizes and multiplies by `gate_up` in one
pass over the input (the row's 1 / rms scales the finished sums), and `areno::silu_row_linear`
takes the activation on the way into `down` and adds the residual to its output, so the next
layer's norm has no add to do (kernels/gemv.py). Two kernels a layer fewer.

Only layers whose code this module mirrors take it (`MIXERS`: Qwen3's, Qwen3.5's), with a norm
it knows (`NORM_OFFSETS`), an MLP of SiLU-gated plain linear layers without bias whose gate and
up are fused (fused_linear.py), and no hooks on them (LoRA's adapters add to those products, so a
runner with adapter slots keeps the layer's own code). Like the engine's other layers it is in
force only inside the engine's forwards (`with row_mlps:`), and there only where the step has
one row (decided at trace time where torch.compile runs it); every other call runs the layer's
own forward.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from areno.engine.kernels import use_triton
from areno.engine.kernels.gemv import (
    add_norm_row_linear,
    add_norm_row_linear_op,
    silu_row_linear,
    silu_row_linear_op,
)
from areno.engine.layers.fused_linear import FusedLinears

# The activations the kernel computes (torch's and transformers' SiLU).
SILU = ("SiLU", "SiLUActivation")
# A norm's weight enters as weight + offset: Qwen3's scales by its weight, Qwen3.5's by 1 + it.
NORM_OFFSETS = {"Qwen3RMSNorm": 0.0, "Qwen3_5RMSNorm": 1.0}


def _qwen3_mixer(
    layer,
    x,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    use_cache=False,
    position_embeddings=None,
    **kwargs,
):
    # transformers' Qwen3DecoderLayer.forward, its attention call.
    out, _ = layer.self_attn(
        hidden_states=x,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    return out


def _qwen3_5_mixer(
    layer,
    x,
    position_embeddings=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    **kwargs,
):
    # transformers' Qwen3_5DecoderLayer.forward, its token mixer.
    if layer.block_type == "linear_attention":
        return layer.linear_attn(
            hidden_states=x, cache_params=past_key_values, attention_mask=attention_mask, **kwargs
        )
    out, _ = layer.self_attn(
        hidden_states=x,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    return out


# A layer class's token mixer on its normed input, called as the layer's own forward calls it
# (the same positional and keyword arguments).
MIXERS: dict[str, Callable] = {
    "Qwen3DecoderLayer": _qwen3_mixer,
    "Qwen3_5DecoderLayer": _qwen3_5_mixer,
}


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class _Layer:
    """One decoder layer that takes the fused MLP half: its modules and fused gate-up weight."""

    def __init__(self, layer: nn.Module, gate_up: nn.Parameter):
        self.layer = layer
        self.mixer = MIXERS[type(layer).__name__]
        self.input_norm = layer.input_layernorm
        self.norm = layer.post_attention_layernorm
        self.eps = _eps(self.norm)
        self.offset = NORM_OFFSETS[type(self.norm).__name__]
        self.mlp = layer.mlp
        self.gate_up = gate_up
        self.original = layer.forward

    def hooked(self) -> bool:
        """Whether anything hooks the MLP's products (LoRA's adapters), which the kernels skip."""
        return any(
            m._forward_hooks or m._forward_pre_hooks
            for m in (self.mlp, self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj)
        )

    def takes(self, x: torch.Tensor) -> bool:
        """Eagerly: whether the kernels compute this call (one row, on the kernels' device, of
        the weights' dtype)."""
        return (
            x.numel() == x.shape[-1]
            and x.dtype == self.gate_up.dtype
            and use_triton(self.gate_up)
            and use_triton(x)
        )

    def fused(self, hidden: torch.Tensor, args: tuple, kwargs: dict, ops: bool) -> torch.Tensor:
        add_norm = add_norm_row_linear_op if ops else add_norm_row_linear
        silu = silu_row_linear_op if ops else silu_row_linear
        mixed = self.mixer(self.layer, self.input_norm(hidden), *args, **kwargs)
        gate_up, summed = add_norm(
            mixed, hidden, self.norm.weight, self.eps, self.offset, self.gate_up
        )
        return silu(gate_up, self.mlp.down_proj.weight, summed)


def _fusable(layer: nn.Module, gate_ups: dict[int, nn.Parameter]) -> bool:
    if type(layer).__name__ not in MIXERS:
        return False
    mlp = getattr(layer, "mlp", None)
    norm = getattr(layer, "post_attention_layernorm", None)
    linears = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (
        type(norm).__name__ in NORM_OFFSETS
        and hasattr(layer, "input_layernorm")
        and type(getattr(mlp, "act_fn", None)).__name__ in SILU
        and all(type(m) is nn.Linear and m.bias is None for m in linears)
        and id(linears[0]) in gate_ups
    )


class RowMlps:
    """Routes the one-row calls of the decoder layers among `modules` that can take it (see the
    module's docstring) to the fused MLP half while active. The routing is installed once:
    entering and leaving, which every forward of the runner does, only flips `active`."""

    def __init__(self, modules: Iterable[nn.Module], fused: FusedLinears):
        gate_ups = {
            id(group.linears[0]): group.weight
            for group in fused.groups
            if group.names == ("gate_proj", "up_proj")
        }
        self._layers = [
            _Layer(m, gate_ups[id(m.mlp.gate_proj)])
            for m in dict.fromkeys(modules)
            if _fusable(m, gate_ups)
        ]
        self.active = False
        self._lock = threading.Lock()
        self._depth = 0
        for entry in self._layers:
            entry.layer.forward = types.MethodType(self._routed(entry), entry.layer)

    def __len__(self) -> int:
        """The decoder layers it routes."""
        return len(self._layers)

    def __enter__(self) -> RowMlps:
        with self._lock:
            self._depth += 1
            self.active = True
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            self.active = self._depth > 0

    def _routed(self, entry: _Layer):
        def forward(layer, hidden_states, *args, **kwargs):
            if self.active and not entry.hooked():
                if torch.compiler.is_compiling():
                    # Traced, only where the graph has one row for certain (as RowLinears).
                    if statically_known_true(hidden_states.numel() == hidden_states.shape[-1]):
                        return entry.fused(hidden_states, args, kwargs, ops=True)
                elif entry.takes(hidden_states):
                    return entry.fused(hidden_states, args, kwargs, ops=False)
            return entry.original(hidden_states, *args, **kwargs)

        return forward
