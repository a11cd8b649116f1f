"""The gated delta rule of Qwen3.5's linear-attention layers, token by token, in one Triton kernel.

For each token:  S <- decay * S;  delta = beta * (v - k^T S);  S <- S + k delta^T;  out = q^T S,
with S the (d_k, d_v) state of one value head. Each program keeps a (d_k, block of d_v) slice
of one row's state in registers, in fp32, for all the tokens it runs, so a decode step reads and
writes the state once, where the PyTorch step makes four passes (six reads or writes) over it:
at 64 rows of the Qwen3.5-2B shape an fp32 state is 1.2 GB per step. A stored state is fp32 or
bf16 (the engine's `linear_state_dtype`): it is read into fp32 and rounded to its own dtype only
when written back, once per launch. A prefill runs the same kernel over the prompt from a zero
state.
"""

from __future__ import annotations

import torch

from areno.engine.kernels import triton

# The dtypes a stored state may have (it is computed in fp32 either way).
STATE_DTYPES = (torch.float32, torch.bfloat16)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _gated_delta_kernel(
        S, Q, K, V, Beta, Decay, Out,
        stride_sb, stride_sn,
        stride_qb, stride_qt, stride_qn,
        stride_kb, stride_kt, stride_kn,
        stride_vb, stride_vt, stride_vn,
        stride_bb, stride_bt,
        stride_db, stride_dt,
        stride_ob, stride_ot, stride_on,
        num_tokens, num_v_heads,
        GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
        HAS_STATE: tl.constexpr, PREFETCH: tl.constexpr,
    ):  # fmt: skip
        row_head = tl.program_id(0)
        b, n = row_head // num_v_heads, row_head % num_v_heads
        kh = n // GROUP  # each key head serves GROUP consecutive value heads
        offs_k = tl.arange(0, DK)
        offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
        s_ptrs = S + b * stride_sb + n * stride_sn + offs_k[:, None] * DV + offs_v[None, :]
        if HAS_STATE:  # noqa: SIM108 (a constexpr branch of the kernel)
            state = tl.load(s_ptrs).to(tl.float32)
        else:
            state = tl.zeros([DK, BV], tl.float32)
        q_ptrs = Q + b * stride_qb + kh * stride_qn + offs_k
        k_ptrs = K + b * stride_kb + kh * stride_kn + offs_k
        v_ptrs = V + b * stride_vb + n * stride_vn + offs_v
        beta_ptr = Beta + b * stride_bb + n
        decay_ptr = Decay + b * stride_db + n
        o_ptrs = Out + b * stride_ob + n * stride_on + offs_v
        # NOTE: with PREFETCH each token's inputs are loaded one token ahead: they do not depend
        # on the state, and waiting for them at the top of every token leaves a long prefill
        # bound by load latency.
        if PREFETCH:
            q = tl.load(q_ptrs).to(tl.float32)
            k = tl.load(k_ptrs).to(tl.float32)
            v = tl.load(v_ptrs).to(tl.float32)
            beta = tl.load(beta_ptr).to(tl.float32)
            decay = tl.load(decay_ptr).to(tl.float32)
        for t in range(num_tokens):
            if PREFETCH:
                ahead = tl.minimum(t + 1, num_tokens - 1)  # the last token reloads itself
                q_next = tl.load(q_ptrs + ahead * stride_qt).to(tl.float32)
                k_next = tl.load(k_ptrs + ahead * stride_kt).to(tl.float32)
                v_next = tl.load(v_ptrs + ahead * stride_vt).to(tl.float32)
                beta_next = tl.load(beta_ptr + ahead * stride_bt).to(tl.float32)
                decay_next = tl.load(decay_ptr + ahead * stride_dt).to(tl.float32)
            else:
                q = tl.load(q_ptrs + t * stride_qt).to(tl.float32)
                k = tl.load(k_ptrs + t * stride_kt).to(tl.float32)
                v = tl.load(v_ptrs + t * stride_vt).to(tl.float32)
                beta = tl.load(beta_ptr + t * stride_bt).to(tl.float32)
                decay = tl.load(decay_ptr + t * stride_dt).to(tl.float32)
            state = state * decay
            delta = (v - tl.sum(state * k[:, None], 0)) * beta
            state = state + k[:, None] * delta[None, :]
            tl.store(o_ptrs + t * stride_ot, tl.sum(state * q[:, None], 0))
            if PREFETCH:
                q, k, v, beta, decay = q_next, k_next, v_next, beta_next, decay_next
        tl.store(s_ptrs, state.to(S.dtype.element_ty))


def fits(key_BTNK: torch.Tensor, value_BTNV: torch.Tensor) -> bool:
    """Power-of-two head dims the kernel's register tiles take (Qwen3.5: 128 and 128)."""
    dk, dv = key_BTNK.shape[-1], value_BTNV.shape[-1]
    return all(16 <= d <= 256 and d & (d - 1) == 0 for d in (dk, dv))


def gated_delta_reference(
    state_BNKV: torch.Tensor | None,
    query_BTNK: torch.Tensor,
    key_BTNK: torch.Tensor,
    value_BTNV: torch.Tensor,
    beta_BTN: torch.Tensor,
    decay_BTN: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch, token by token. query / key (B, T, N_k, d_k), already l2-normalised (and
    the query scaled); value (B, T, N_v, d_v); beta and decay (a factor, not its log) (B, T, N_v);
    state (B, N_v, d_k, d_v) fp32, or None for a zero one. Returns (out (B, T, N_v, d_v) fp32,
    the final state); the given state is not modified."""
    batch, num_tokens, num_v, dv = value_BTNV.shape
    group = num_v // key_BTNK.shape[2]
    q = query_BTNK.float().repeat_interleave(group, dim=2)
    k = key_BTNK.float().repeat_interleave(group, dim=2)
    if state_BNKV is None:
        state_BNKV = q.new_zeros((batch, num_v, q.shape[-1], dv))
    state = state_BNKV.float().clone()
    outs = []
    for t in range(num_tokens):
        state = state * decay_BTN[:, t, :, None, None].float()
        recalled = torch.einsum("bnk,bnkv->bnv", k[:, t], state)
        delta = (value_BTNV[:, t].float() - recalled) * beta_BTN[:, t, :, None].float()
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bnk,bnkv->bnv", q[:, t], state))
    return torch.stack(outs, dim=1), state


def gated_delta(
    state_BNKV: torch.Tensor | None,
    query_BTNK: torch.Tensor,
    key_BTNK: torch.Tensor,
    value_BTNV: torch.Tensor,
    beta_BTN: torch.Tensor,
    decay_BTN: torch.Tensor,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
    prefetch: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_reference`'s arithmetic in one kernel, except that a given state (fp32 or
    bf16) is updated in place (and returned); None starts from zero and returns a new fp32 state.

    `block_v` (value columns per program), `num_warps` and `prefetch` (each token's inputs
    loaded a token ahead) are the launch's choices, for the kernel benchmark; None takes the
    engine's (`launch_choices`)."""
    batch, num_tokens, num_v, dv = value_BTNV.shape
    dk = key_BTNK.shape[-1]
    fresh = state_BNKV is None
    if fresh:
        state_BNKV = value_BTNV.new_empty((batch, num_v, dk, dv), dtype=torch.float32)
    assert state_BNKV.dtype in STATE_DTYPES and state_BNKV.stride(-1) == 1
    assert state_BNKV.stride(-2) == dv, "each head's (d_k, d_v) state is contiguous"
    query_BTNK, key_BTNK, value_BTNV, beta_BTN, decay_BTN = (
        t if t.stride(-1) == 1 else t.contiguous()
        for t in (query_BTNK, key_BTNK, value_BTNV, beta_BTN, decay_BTN)
    )
    out = value_BTNV.new_empty((batch, num_tokens, num_v, dv), dtype=torch.float32)
    chosen = launch_choices(num_tokens, dv, state_BNKV.dtype)
    block_v = block_v or chosen["block_v"]
    num_warps = num_warps or chosen["num_warps"]
    prefetch = chosen["prefetch"] if prefetch is None else prefetch
    _gated_delta_kernel[(batch * num_v, dv // block_v)](
        state_BNKV, query_BTNK, key_BTNK, value_BTNV, beta_BTN, decay_BTN, out,
        state_BNKV.stride(0), state_BNKV.stride(1),
        query_BTNK.stride(0), query_BTNK.stride(1), query_BTNK.stride(2),
        key_BTNK.stride(0), key_BTNK.stride(1), key_BTNK.stride(2),
        value_BTNV.stride(0), value_BTNV.stride(1), value_BTNV.stride(2),
        beta_BTN.stride(0), beta_BTN.stride(1),
        decay_BTN.stride(0), decay_BTN.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        num_tokens, num_v,
        GROUP=num_v // key_BTNK.shape[2], DK=dk, DV=dv, BV=block_v, HAS_STATE=not fresh,
        PREFETCH=prefetch, num_warps=num_warps,
    )  # fmt: skip
    return out, state_BNKV


def launch_choices(num_tokens: int, dv: int, state_dtype: torch.dtype = torch.float32) -> dict:
    """The engine's launch of the kernel. A decode step: 32 value columns per program and 4
    warps, which read and write an fp32 state at its copy bandwidth; a bf16 state, half the
    bytes, 64 columns and 2 warps: at 64 rows of the Qwen3.5-2B shape 16.7 us a layer, 99% of
    its copy floor, where the fp32 state's launch took 23.1 us (39.4 us for an fp32 state;
    benchmarks/engine_kernels.py --kernels gated-delta, a sweep of 32-128 columns and 2-8
    warps). A prefill: 16 columns, one warp, each token's inputs loaded a token ahead. On an
    H200, 32 prompts x 256 tokens of the Qwen3.5-2B shape took 0.69-0.70 ms so, against
    1.06-1.09 ms with the decode's launch (benchmarks/engine_kernels.py, two runs; its sweep of
    columns, warps and loading ahead gave 0.69 to 31.9 ms)."""
    if num_tokens == 1 and state_dtype == torch.bfloat16:
        return {"block_v": min(dv, 64), "num_warps": 2, "prefetch": False}
    if num_tokens == 1:
        return {"block_v": min(dv, 32), "num_warps": 4, "prefetch": False}
    return {"block_v": min(dv, 16), "num_warps": 1, "prefetch": True}
