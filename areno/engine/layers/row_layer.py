"""A Qwen-style decoder layer at one row (a decode step of one sequence) with its norms, residual
adds and activation folded into its products.

At one row a layer's step is a dozen short kernels, each a few microseconds of launch and tail
for little work (docs/performance.md, "Where a step's time goes"). A Qwen-style layer runs: the
input norm (one kernel, with the last layer's residual add), the token mixer's input
projections, the mixer, the residual add and the norm (one kernel), `gate_up`, the activation
(one kernel) and `down`. Here (kernels/gemv.py):
- the mixer's fused input projections apply the input norm as they read their input
  (`areno::norm_row_linear`: each input scaled by its norm weight on the way in, the row's
  1 / rms applied to the finished sums, so one pass does both);
- `areno::add_norm_row_linear` adds the residual, normalizes, multiplies by `gate_up` and
  takes the activation: a program computes output n of the gate and of the up, and stores
  silu(gate) * up;
- `areno::residual_row_linear` adds the residual to `down`'s output, so the next layer's input
  is whole.
Three kernels a layer fewer.

Not yet a gain, so the runner keeps it off (`ModelRunner(row_layer=...)`). On an H100
(`benchmarks/profile_decode.py --model qwen3-1.7b --rows 1 --one-row-gemv on --row-layer off
on`) the three kernels a layer went (0.13 ms of the 1.7B shape's step), but the first cut made
the fused products as much slower (2.08 -> 2.07 ms a step; the 8B shape 6.17 -> 6.30 ms): at the
plain kernel's launch (2-4 outputs a program) every program worked the whole input over, and
`down`'s programs each took the activation of all of its input again. Then the activation was
taken once, in `gate_up`'s epilogue, with 8 weight rows a program: no faster (2.09 -> 2.10 ms).
A sweep of each fused product's launch (`benchmarks/decode_gemv.py --fused`) found 2 rows a
program fastest, about 2 us a layer under the plain products and the kernels they replace, so
`fused_launch_options` launches that; the layer's step at that launch is not measured yet.

Only layers whose code this module mirrors take it (`MIXERS`: Qwen3's, Qwen3.5's), with norms
it knows (`NORM_OFFSETS`), an MLP of SiLU-gated plain linear layers without bias whose gate and
up are fused (fused_linear.py), and no hooks on their linear layers (LoRA's adapters add to those
products from their inputs, so a runner with adapter slots keeps the layer's own code). The input
norm is folded where the mixer's input projections are one fused group without bias; elsewhere
the norm runs as the layer's code runs it. Like the engine's other layers it is in force only
inside the engine's forwards (`with row_layers:`), and there only where the step has one row
(decided at trace time where torch.compile runs it); every other call runs the layer's own
forward.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from areno.engine.kernels import use_triton
from areno.engine.kernels.gemv import (
    add_norm_row_linear,
    add_norm_row_linear_op,
    residual_row_linear,
    residual_row_linear_op,
)
from areno.engine.layers.fused_linear import FusedLinears
from areno.engine.layers.switch import Switch

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
    """One decoder layer that takes the fused path: its modules, its fused gate-up weight and
    the fused group of its mixer's input projections (None: its input norm runs apart)."""

    def __init__(self, layer: nn.Module, gate_up: nn.Parameter, groups: dict[int, object]):
        self.layer = layer
        self.mixer = MIXERS[type(layer).__name__]
        self.input_norm = layer.input_layernorm
        self.norm = layer.post_attention_layernorm
        self.eps = _eps(self.norm)
        self.offset = NORM_OFFSETS[type(self.norm).__name__]
        self.mlp = layer.mlp
        self.gate_up = gate_up
        self.original = layer.forward
        self.linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
        mixer = getattr(layer, "self_attn", None) or getattr(layer, "linear_attn", None)
        first = getattr(mixer, "q_proj", None) or getattr(mixer, "in_proj_qkv", None)
        group = groups.get(id(first))
        folds = group is not None and group.bias is None
        self.input_group = (
            group if folds and type(self.input_norm).__name__ in NORM_OFFSETS else None
        )
        self.input_eps = _eps(self.input_norm)
        self.input_offset = NORM_OFFSETS.get(type(self.input_norm).__name__, 0.0)

    def hooked(self) -> bool:
        """Whether anything hooks the layer's products (LoRA's adapters, which add to a product
        from its input): the kernels would skip those hooks, or give them another input."""
        return any(m._forward_hooks or m._forward_pre_hooks for m in (self.mlp, *self.linears))

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
        residual_linear = residual_row_linear_op if ops else residual_row_linear
        if self.input_group is None:
            mixed = self.mixer(self.layer, self.input_norm(hidden), *args, **kwargs)
        else:
            # The group's next product (the mixer's first projection of its input) applies
            # the norm; the other projections take their slices of it.
            self.input_group.norm = (self.input_norm.weight, self.input_eps, self.input_offset)
            mixed = self.mixer(self.layer, hidden, *args, **kwargs)
            if self.input_group.norm is not None:  # (when traced, said at trace time)
                self.input_group.norm = None
                raise RuntimeError(
                    f"{type(self.layer).__name__}'s mixer did not call its first input "
                    "projection first: its input norm cannot be folded into it"
                )
        activation, summed = add_norm(
            mixed, hidden, self.norm.weight, self.eps, self.offset, self.gate_up, True
        )
        return residual_linear(activation, self.mlp.down_proj.weight, summed)


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


class RowLayers(Switch):
    """Routes the one-row calls of the decoder layers among `modules` that can take it (see the
    module's docstring) to the fused path while active. The routing is installed once: entering
    and leaving, which every forward of the runner does, only flips `active`."""

    def __init__(self, modules: Iterable[nn.Module], fused: FusedLinears):
        gate_ups = {
            id(group.linears[0]): group.weight
            for group in fused.groups
            if group.names == ("gate_proj", "up_proj")
        }
        groups = {id(group.linears[0]): group for group in fused.groups}
        self._layers = [
            _Layer(m, gate_ups[id(m.mlp.gate_proj)], groups)
            for m in dict.fromkeys(modules)
            if _fusable(m, gate_ups)
        ]
        super().__init__()
        for entry in self._layers:
            entry.layer.forward = types.MethodType(self._routed(entry), entry.layer)

    def __len__(self) -> int:
        """The decoder layers it routes."""
        return len(self._layers)

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
