"""Decode step of Qwen3.5's gated-delta-net (linear-attention) layers, for the engine's batches.

Without the flash-linear-attention / causal-conv1d kernels, transformers runs a one-token decode
through reference code that makes about a dozen passes over each row's (heads, d_k, d_v)
recurrent state and a oneDNN grouped convolution for a 4-tap filter. On a 2-core CPU that was
half of a decode step of the small checkpoint. The step here does the same arithmetic in one
pass over the state on CUDA (the Triton kernel of `kernels/gated_delta.py`), in four elsewhere
(decay in place, two batched matmuls, one in-place rank-1 update), the conv as a weighted sum,
and writes both states in place into the cache's tensors.

A prefill (a fresh state, any number of tokens) runs the token-by-token kernel over the prompt
on CUDA, or for a long prompt the chunked form of the rule (`kernels/chunked_delta.py`: one
sequential step per chunk of tokens, its products on tensor cores); elsewhere the same chunked
form in PyTorch (`chunked_gated_delta_torch`; `benchmarks/cpu_delta_rule.py` on 2 CPU cores, the
small checkpoint's heads: 1.3-2.6x transformers' chunked rule from 1 x 32 to 32 x 256 tokens,
except 4 x 165: 0.7-0.8x in two runs of three, 2.1x in the third), with the conv written as K
shifted multiply-adds: oneDNN's grouped convolution took 2.6 ms for a 160-token prompt of the small checkpoint, these
take a tenth of that. A prompt's later chunk (a multi-token forward over a cached state) runs the
same prefill path from the slot's conv and recurrent states.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from areno.engine.kernels import use_triton
from areno.engine.kernels.chunked_delta import (
    CHUNKED_MIN_TOKENS,
    chunked_gated_delta,
    chunked_gated_delta_torch,
)
from areno.engine.kernels.chunked_delta import fits as chunked_fits
from areno.engine.kernels.gated_delta import fits as gated_delta_fits
from areno.engine.kernels.gated_delta import gated_delta

# The attributes the step reads from a gated-delta-net module (transformers' Qwen3_5GatedDeltaNet).
_REQUIRED = (
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "conv1d",
    "A_log",
    "dt_bias",
    "norm",
    "out_proj",
    "head_k_dim",
    "head_v_dim",
    "key_dim",
    "layer_idx",
)


class EngineKernels:
    """The engine's gated-delta-net paths for one model, active only inside `with kernels:`.

    Outside (a user's own `model.generate`, a parity reference) every layer runs transformers'
    code, so installing them never changes what the model computes for anyone else.
    """

    def __init__(self, model: torch.nn.Module):
        self.active = False
        self.num_layers = 0
        for module in model.modules():
            if type(module).__name__.endswith("GatedDeltaNet") and all(
                hasattr(module, name) for name in _REQUIRED
            ):
                module.forward = types.MethodType(self._forward(module.forward), module)
                self.num_layers += 1

    def __enter__(self) -> EngineKernels:
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False

    def _forward(self, original):
        def forward(module, hidden_states, cache_params=None, attention_mask=None, **kwargs):
            if not self.active or kwargs.get("cu_seq_lens_q") is not None:
                return original(hidden_states, cache_params, attention_mask, **kwargs)
            if cache_params is None:
                return prefill_step(module, hidden_states, None, attention_mask)
            conv_state = cache_params.get_conv_state(module.layer_idx, state_idx=0)
            recurrent_state = cache_params.get_recurrent_state(module.layer_idx, state_idx=0)
            if conv_state is None or recurrent_state is None:
                lengths_B = _row_lengths(cache_params)
                return prefill_step(module, hidden_states, cache_params, attention_mask, lengths_B)
            if hidden_states.shape[1] == 1 and attention_mask is None:
                return decode_step(module, hidden_states, conv_state, recurrent_state)
            if attention_mask is None and not isinstance(hidden_states, DTensor):
                # a prompt's later chunk, or several rows' parts (right-padded): states continue
                return prefill_step(
                    module,
                    hidden_states,
                    cache_params,
                    None,
                    _row_lengths(cache_params),
                    states=(conv_state, recurrent_state),
                )
            return original(hidden_states, cache_params, attention_mask, **kwargs)

        return forward


def _row_lengths(cache_params) -> torch.Tensor | None:
    """The real token count of each right-padded row of the forward (the engine's cache's
    binding), None without padding."""
    binding = getattr(cache_params, "binding", None)
    return binding.lengths_B if binding is not None else None


def prefill_step(
    module: torch.nn.Module,
    hidden_BLH: torch.Tensor,
    cache_params,
    padding_mask_BL: torch.Tensor | None,
    lengths_B: torch.Tensor | None = None,
    states: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """A whole prompt from a fresh state, or with `states` (conv, recurrent: the tensors
    `cache_params` holds) a chunk continuing them; leaves the conv and recurrent states in
    `cache_params` (when given). `padding_mask_BL` zeroes padded positions (left padding), as
    transformers does.

    `lengths_B`: right-padded prompts (or parts of prompts, with `states`), row b real up to
    `lengths_B[b]`. Every operation is causal, so the real positions' outputs ignore the pads;
    the states are taken at each row's last real token: the conv keeps that token's last K
    inputs, and at pad positions the delta rule gets beta 0 and decay 1, which leaves the
    recurrent state as it was."""
    if padding_mask_BL is not None:
        hidden_BLH = (hidden_BLH * padding_mask_BL[:, :, None]).to(hidden_BLH.dtype)
    batch, length, _ = hidden_BLH.shape
    mixed_BCL = module.in_proj_qkv(hidden_BLH).transpose(1, 2)
    weight_CK = module.conv1d.weight[:, 0]
    kernel = weight_CK.shape[-1]
    if states is not None:  # the conv sees the inputs before the chunk
        conv_state_BCK = states[0]
        width = conv_state_BCK.shape[-1]
        joined_BCL = torch.cat([conv_state_BCK.to(mixed_BCL.dtype), mixed_BCL], dim=-1)
        if lengths_B is None:
            kept_BCK = joined_BCL[:, :, -width:]
        else:  # the `width` inputs up to each row's last real one
            kept_BCK = _last_inputs(joined_BCL, lengths_B + width, width)
        conv_BCL = _causal_conv(
            joined_BCL[:, :, width - (kernel - 1) :], weight_CK, module.conv1d.bias
        )
        conv_BCL = conv_BCL[:, :, kernel - 1 :]
        conv_state_BCK.copy_(kept_BCK.to(conv_state_BCK.dtype))
    else:
        if cache_params is not None:
            last_inputs = mixed_BCL
            if lengths_B is not None:
                last_inputs = _last_inputs(mixed_BCL, lengths_B, kernel)
            cache_params.update_conv_state(last_inputs, module.layer_idx, conv_kernel_size=kernel)
        conv_BCL = _causal_conv(mixed_BCL, weight_CK, module.conv1d.bias)
    mixed_BLC = F.silu(conv_BCL).transpose(1, 2)

    value_dim = mixed_BLC.shape[-1] - 2 * module.key_dim
    query, key, value = torch.split(mixed_BLC, [module.key_dim, module.key_dim, value_dim], dim=-1)
    dk, dv = module.head_k_dim, module.head_v_dim
    beta_BLN = module.in_proj_b(hidden_BLH).sigmoid()
    a_BLN = module.in_proj_a(hidden_BLH).float()
    g_BLN = -module.A_log.float().exp() * F.softplus(a_BLN + module.dt_bias)
    if lengths_B is not None:
        real_BL1 = (torch.arange(length, device=lengths_B.device) < lengths_B[:, None])[..., None]
        beta_BLN = beta_BLN * real_BL1
        g_BLN = g_BLN * real_BL1
    query_BLNK = query.reshape(batch, length, -1, dk)
    key_BLNK = key.reshape(batch, length, -1, dk)
    value_BLNV = value.reshape(batch, length, -1, dv)
    if isinstance(hidden_BLH, DTensor):
        # A tensor-parallel shard that kept its sharding: transformers' rule, in plain operators.
        chunk_rule = sys.modules[type(module).__module__].torch_chunk_gated_delta_rule
        out_BLNV, state = chunk_rule(
            query_BLNK,
            key_BLNK,
            value_BLNV,
            g=g_BLN,
            beta=beta_BLN,
            initial_state=None,
            output_final_state=cache_params is not None,
            use_qk_l2norm_in_kernel=True,
        )
    else:
        query_BLNK = _l2norm(query_BLNK.float()) * dk**-0.5
        key_BLNK = _l2norm(key_BLNK.float())
        initial = states[1] if states is not None else None
        out_BLNV, state = prefill_delta_rule(
            query_BLNK, key_BLNK, value_BLNV, beta_BLN, g_BLN, initial
        )
        out_BLNV = out_BLNV.to(value.dtype)
    if cache_params is not None:
        cache_params.update_recurrent_state(state, module.layer_idx)
    gate = module.in_proj_z(hidden_BLH).reshape(-1, dv)
    out = module.norm(out_BLNV.reshape(-1, dv), gate)
    return module.out_proj(out.reshape(batch, length, -1))


def _last_inputs(x_BCL: torch.Tensor, lengths_B: torch.Tensor, kernel: int) -> torch.Tensor:
    """Each row's last `kernel` real inputs (B, C, kernel), zeros before a short row's first."""
    index_BK = lengths_B[:, None] - kernel + torch.arange(kernel, device=lengths_B.device)
    index_BCK = index_BK.clamp(min=0)[:, None, :].expand(-1, x_BCL.shape[1], -1)
    return x_BCL.gather(-1, index_BCK) * (index_BK >= 0)[:, None, :].to(x_BCL.dtype)


def _causal_conv(x_BCL: torch.Tensor, weight_CK: torch.Tensor, bias_C) -> torch.Tensor:
    """Depthwise causal conv: out[:, c, t] = sum_k weight[c, k] * x[:, c, t - K + 1 + k]."""
    kernel, length = weight_CK.shape[-1], x_BCL.shape[-1]
    padded = F.pad(x_BCL.to(weight_CK.dtype), (kernel - 1, 0))
    out = padded[:, :, :length] * weight_CK[:, :1]
    for k in range(1, kernel):
        out = out.addcmul_(padded[:, :, k : k + length], weight_CK[:, k : k + 1])
    if bias_C is not None:
        out = out + bias_C[:, None]
    return out.to(x_BCL.dtype)


def decode_step(
    module: torch.nn.Module,
    hidden_B1H: torch.Tensor,
    conv_state_BCK: torch.Tensor,
    state_BNKV: torch.Tensor,
) -> torch.Tensor:
    """One token per row through a gated-delta-net layer; updates both states in place.

    conv_state_BCK: the last K inputs of the causal conv per channel. state_BNKV: the recurrent
    state per value head, (d_k, d_v), fp32 or bf16 (computed in fp32 either way). Returns the
    layer output (B, 1, hidden).
    """
    batch = hidden_B1H.shape[0]
    hidden_BH = hidden_B1H[:, 0]
    mixed_BC = module.in_proj_qkv(hidden_BH)

    # Causal conv over the last K inputs (the state keeps K), then SiLU.
    weight_CK = module.conv1d.weight[:, 0]
    kernel = weight_CK.shape[-1]
    assert conv_state_BCK.shape[-1] >= kernel, "the conv state keeps at least the kernel's taps"
    window_BCK = torch.cat([conv_state_BCK[:, :, 1:], mixed_BC[:, :, None]], dim=-1)
    conv_state_BCK.copy_(window_BCK[:, :, -conv_state_BCK.shape[-1] :])
    mixed_BC = (window_BCK[:, :, -kernel:] * weight_CK).sum(-1)
    if module.conv1d.bias is not None:
        mixed_BC = mixed_BC + module.conv1d.bias
    mixed_BC = F.silu(mixed_BC)

    value_dim = mixed_BC.shape[-1] - 2 * module.key_dim
    query, key, value = torch.split(mixed_BC, [module.key_dim, module.key_dim, value_dim], dim=-1)
    dk, dv = module.head_k_dim, module.head_v_dim
    value_BNV = value.reshape(batch, -1, dv).float()
    query_BNK = _l2norm(query.reshape(batch, -1, dk).float()) * dk**-0.5
    key_BNK = _l2norm(key.reshape(batch, -1, dk).float())

    beta_BN = module.in_proj_b(hidden_BH).float().sigmoid()
    a_BN = module.in_proj_a(hidden_BH).float()
    decay_BN = torch.exp(-module.A_log.float().exp() * F.softplus(a_BN + module.dt_bias))

    out_BNV = recurrent_update(state_BNKV, decay_BN, query_BNK, key_BNK, value_BNV, beta_BN)

    gate = module.in_proj_z(hidden_BH).reshape(-1, dv)
    out = module.norm(out_BNV.to(hidden_B1H.dtype).reshape(-1, dv), gate)
    return module.out_proj(out.reshape(batch, 1, -1))


# NOTE: a custom op, so that the choice between the two kernels is made per call on the real
# length, and the PyTorch rule's loop over chunks runs as plain Python; traced, either would be
# a guard on the prompt length (the loop's on its number of chunks), and a compiled prefill
# would compile again for the first prompt on the other side of it.
@torch.library.custom_op("areno::prefill_delta_rule", mutates_args=())
def prefill_delta_rule(
    query_BTNK: torch.Tensor,
    key_BTNK: torch.Tensor,
    value_BTNV: torch.Tensor,
    beta_BTN: torch.Tensor,
    log_decay_BTN: torch.Tensor,
    initial_state_BNKV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill's gated delta rule from a zero state, or from `initial_state_BNKV` (not
    written: a prompt's later chunk) (`gated_delta_reference`'s arithmetic, the decay given by
    its log). On CUDA one of the engine's Triton kernels: in chunks for prompts of
    CHUNKED_MIN_TOKENS or more from a zero state (`kernels/chunked_delta.py`), token by token
    otherwise (the chunked form's parallel work costs more than the token kernel's chain of
    steps below that); elsewhere the chunked form in PyTorch. Returns (out (B, T, N_v, d_v)
    fp32, state (B, N_v, d_k, d_v) fp32)."""
    args = (query_BTNK, key_BTNK, value_BTNV, beta_BTN, log_decay_BTN)
    if not (use_triton(query_BTNK) and gated_delta_fits(key_BTNK, value_BTNV)):
        out, state = chunked_gated_delta_torch(*args, initial_state_BNKV=initial_state_BNKV)
        return out.contiguous(), state  # the layout the fake promises (a compiled graph checks)
    if initial_state_BNKV is not None:
        state = initial_state_BNKV.float().clone()  # the kernel updates it in place
        return gated_delta(state, *args[:4], log_decay_BTN.exp())
    if query_BTNK.shape[1] >= CHUNKED_MIN_TOKENS and chunked_fits(key_BTNK, value_BTNV):
        return chunked_gated_delta(*args)
    return gated_delta(None, query_BTNK, key_BTNK, value_BTNV, beta_BTN, log_decay_BTN.exp())


@prefill_delta_rule.register_fake
def _(query_BTNK, key_BTNK, value_BTNV, beta_BTN, log_decay_BTN, initial_state_BNKV=None):
    batch, num_tokens, num_v, dv = value_BTNV.shape
    out = value_BTNV.new_empty((batch, num_tokens, num_v, dv), dtype=torch.float32)
    return out, value_BTNV.new_empty((batch, num_v, key_BTNK.shape[-1], dv), dtype=torch.float32)


# NOTE: a custom op that mutates the state, so a compiled decode step calls it without a graph
# break and updates the cache's state in place. Traced as plain operators, the in-place updates
# became an out-of-place update plus a copy back (two more passes over the largest tensor of the
# step); behind `torch.compiler.disable`, the frame resuming after it was compiled once per layer.
@torch.library.custom_op("areno::recurrent_update_", mutates_args=("state_BNKV",))
def recurrent_update(
    state_BNKV: torch.Tensor,
    decay_BN: torch.Tensor,
    query_BNK: torch.Tensor,
    key_BNK: torch.Tensor,
    value_BNV: torch.Tensor,
    beta_BN: torch.Tensor,
) -> torch.Tensor:
    """S <- decay * S;  delta = beta * (v - k^T S);  S <- S + k delta^T;  out = q^T S. Updates
    the state in place: one pass over it in the Triton kernel (CUDA), four in PyTorch. A key head
    serves N / N_k consecutive value heads. Returns out (B, N, d_v)."""
    if use_triton(state_BNKV) and gated_delta_fits(key_BNK, value_BNV):
        one_token = (t[:, None] for t in (query_BNK, key_BNK, value_BNV, beta_BN, decay_BN))
        return gated_delta(state_BNKV, *one_token)[0][:, 0]
    batch, num_v, dk, dv = state_BNKV.shape
    query_BNK, key_BNK = _expand_heads(query_BNK, num_v), _expand_heads(key_BNK, num_v)
    state = state_BNKV.view(batch * num_v, dk, dv)
    if state.dtype != torch.float32:  # a bf16 state: computed in fp32, rounded once
        state = state.float()
    state.mul_(decay_BN.reshape(-1, 1, 1))
    key_col = key_BNK.reshape(-1, dk, 1)
    recalled = torch.bmm(key_col.transpose(1, 2), state)  # (BN, 1, dv)
    delta = (value_BNV.reshape(-1, 1, dv) - recalled) * beta_BN.reshape(-1, 1, 1)
    state.baddbmm_(key_col, delta)
    out = torch.bmm(query_BNK.reshape(-1, 1, dk), state).reshape(batch, num_v, dv)
    if state.dtype != state_BNKV.dtype:
        state_BNKV.copy_(state.view(state_BNKV.shape))
    return out


@recurrent_update.register_fake
def _(state_BNKV, decay_BN, query_BNK, key_BNK, value_BNV, beta_BN):
    return value_BNV.new_empty(value_BNV.shape, dtype=torch.float32)


def _expand_heads(x_BHD: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Each key head serves num_heads // H consecutive value heads."""
    if x_BHD.shape[1] == num_heads:
        return x_BHD
    return x_BHD.repeat_interleave(num_heads // x_BHD.shape[1], dim=1)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and FLA's) l2norm: x * rsqrt(sum(x^2) + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
