"""The gated delta rule over a whole prompt in chunks: the prefill form of `gated_delta.py`'s
recurrence, with its sequential part one step per chunk instead of one per token.

Within a chunk of C tokens (cumulative log-decay G_t, Γ_t = exp(G_t), state S at its start), the
token-by-token rule is equivalent to (the WY form of the delta rule, as in Gated DeltaNet):

    A[t, s]  = beta_t exp(G_t - G_s) k_t.k_s   for s < t        (strictly lower, C x C)
    T        = (I + A)^-1                                         (forward substitution)
    W        = T diag(beta Γ) K,   Ũ = T diag(beta) V            (C x d_k, C x d_v)
    U        = Ũ - W S                                            (each token's delta)
    out      = diag(Γ) Q S + (exp(G_t - G_s) q_t.k_s, s <= t) U
    S       <- Γ_C S + (K diag(exp(G_C - G)))^T U

`_chunk_kernel` computes T, W, Ũ and the masked Q K^T of every chunk in parallel;
`_scan_kernel` carries S across a row's chunks, one program per (row, value head, block of
value columns). The products run in TF32 on tensor cores for a bfloat16 / float16 model (finer
than the activations' own rounding) and in full fp32 ("ieee", without them, about 12x slower on
an H200) for a float32 one. The state itself is accumulated in fp32 throughout.

Why: the token-by-token kernel runs a prompt's tokens one after another, so a long prompt is
bound by the latency of each token's step; here a 4096-token prompt takes 4096 / C steps.
"""

from __future__ import annotations

import torch

from areno.engine.kernels import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """a @ b in fp32: full precision, or TF32 (the default for fp32 operands)."""
        return tl.dot(a, b, input_precision="ieee") if IEEE else tl.dot(a, b)

    @triton.jit
    def _chunk_kernel(
        Q, K, V, Beta, LogDecay, W, U, P, G,
        stride_qb, stride_qt, stride_qn,
        stride_kb, stride_kt, stride_kn,
        stride_vb, stride_vt, stride_vn,
        stride_bb, stride_bt,
        stride_gb, stride_gt,
        num_tokens, num_v_heads, num_chunks,
        GROUP: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        row_head, c = tl.program_id(0), tl.program_id(1)
        b, n = row_head // num_v_heads, row_head % num_v_heads
        kh = n // GROUP
        rows = tl.arange(0, C)
        t = c * C + rows
        real = t < num_tokens
        offs_k, offs_v = tl.arange(0, DK), tl.arange(0, DV)
        k_ptrs = K + b * stride_kb + t[:, None] * stride_kt + kh * stride_kn + offs_k[None, :]
        q_ptrs = Q + b * stride_qb + t[:, None] * stride_qt + kh * stride_qn + offs_k[None, :]
        v_ptrs = V + b * stride_vb + t[:, None] * stride_vt + n * stride_vn + offs_v[None, :]
        k = tl.load(k_ptrs, mask=real[:, None], other=0.0).to(tl.float32)
        beta = tl.load(Beta + b * stride_bb + t * stride_bt + n, mask=real, other=0.0)
        log_decay = tl.load(LogDecay + b * stride_gb + t * stride_gt + n, mask=real, other=0.0)
        beta, cum = beta.to(tl.float32), tl.cumsum(log_decay.to(tl.float32), 0)

        below = rows[:, None] > rows[None, :]
        # exp only where t >= s: above the diagonal the difference is positive and may overflow.
        gap = tl.where(rows[:, None] >= rows[None, :], cum[:, None] - cum[None, :], float("-inf"))
        decay_ts = tl.exp(gap)
        kk = _dot(k, tl.trans(k), IEEE)
        a = tl.where(below, beta[:, None] * decay_ts * kk, 0.0)
        # T = (I + A)^-1 by forward substitution: row i is e_i - sum_{j<i} A[i, j] T[j, :], and
        # the rows above it are final when it is computed.
        inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
        for i in range(1, C):
            a_i = tl.sum(tl.where(rows[:, None] == i, a, 0.0), 0)
            r = tl.sum(a_i[:, None] * inv, 0)
            inv = tl.where(rows[:, None] == i, inv - r[None, :], inv)

        base = row_head * num_chunks * C + c * C  # row (b, n)'s chunk c in the scratch tensors
        kb = k * (beta * tl.exp(cum))[:, None]
        w = _dot(inv, kb, IEEE)
        tl.store(W + (base + rows)[:, None] * DK + offs_k[None, :], w)
        v = tl.load(v_ptrs, mask=real[:, None], other=0.0).to(tl.float32)
        u = _dot(inv, v * beta[:, None], IEEE)
        tl.store(U + (base + rows)[:, None] * DV + offs_v[None, :], u)
        q = tl.load(q_ptrs, mask=real[:, None], other=0.0).to(tl.float32)
        qk = _dot(q, tl.trans(k), IEEE) * decay_ts
        tl.store(P + (base + rows)[:, None] * C + rows[None, :], qk)
        tl.store(G + base + rows, cum)

    @triton.jit
    def _scan_kernel(
        Q, K, W, U, P, G, Out, S,
        stride_qb, stride_qt, stride_qn,
        stride_kb, stride_kt, stride_kn,
        stride_ob, stride_ot, stride_on,
        num_tokens, num_v_heads, num_chunks,
        GROUP: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BV: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        row_head = tl.program_id(0)
        b, n = row_head // num_v_heads, row_head % num_v_heads
        kh = n // GROUP
        rows = tl.arange(0, C)
        offs_k = tl.arange(0, DK)
        offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
        state = tl.zeros([DK, BV], tl.float32)
        for c in range(num_chunks):
            t = c * C + rows
            real = t < num_tokens
            base = row_head * num_chunks * C + c * C
            w = tl.load(W + (base + rows)[:, None] * DK + offs_k[None, :])
            u = tl.load(U + (base + rows)[:, None] * DV + offs_v[None, :])
            qk = tl.load(P + (base + rows)[:, None] * C + rows[None, :])
            cum = tl.load(G + base + rows)
            last = tl.load(G + base + C - 1)  # pads after a prompt's end have log-decay 0
            q_ptrs = Q + b * stride_qb + t[:, None] * stride_qt + kh * stride_qn + offs_k[None, :]
            k_ptrs = K + b * stride_kb + t[:, None] * stride_kt + kh * stride_kn + offs_k[None, :]
            q = tl.load(q_ptrs, mask=real[:, None], other=0.0).to(tl.float32)
            k = tl.load(k_ptrs, mask=real[:, None], other=0.0).to(tl.float32)
            delta = u - _dot(w, state, IEEE)
            out = _dot(q * tl.exp(cum)[:, None], state, IEEE)
            out += _dot(qk, delta, IEEE)
            o_ptrs = Out + b * stride_ob + t[:, None] * stride_ot + n * stride_on + offs_v[None, :]
            tl.store(o_ptrs, out, mask=real[:, None])
            k_end = k * tl.exp(last - cum)[:, None]
            state = state * tl.exp(last) + _dot(tl.trans(k_end), delta, IEEE)
        s_ptrs = S + row_head * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
        tl.store(s_ptrs, state)


CHUNK = 32
# From this prompt length the engine's prefills take the chunked form. On an H200 (Qwen3.5-2B
# heads, bfloat16; benchmarks/engine_kernels.py) the token-by-token kernel took 0.70 ms for 32
# prompts of 256 tokens and this one 1.00; for 4 prompts of 4096, 2.16 and 1.87; for one of
# 16384, 8.23 and 3.18. A prefill step's token budget (8192 by default) leaves few rows to a
# long prompt, where the token kernel's programs are few and each token's step is a wait.
CHUNKED_MIN_TOKENS = 4096


def fits(key_BTNK: torch.Tensor, value_BTNV: torch.Tensor) -> bool:
    """Power-of-two head dims from 16 (tl.dot's smallest tile) to 256."""
    dk, dv = key_BTNK.shape[-1], value_BTNV.shape[-1]
    return all(16 <= d <= 256 and d & (d - 1) == 0 for d in (dk, dv))


def chunked_gated_delta(
    query_BTNK: torch.Tensor,
    key_BTNK: torch.Tensor,
    value_BTNV: torch.Tensor,
    beta_BTN: torch.Tensor,
    log_decay_BTN: torch.Tensor,
    *,
    chunk: int = CHUNK,
    block_v: int = 32,
    precision: str | None = None,
    scan_stages: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_reference` from a zero state, with the decay given by its log (the factor is
    exp(log_decay_BTN)). Returns (out (B, T, N_v, d_v) fp32, final state (B, N_v, d_k, d_v)
    fp32). `precision`: the products' ("tf32" or "ieee"); None takes TF32 for a bfloat16 /
    float16 `value_BTNV` and ieee otherwise. `scan_stages`: the scan kernel's software
    pipelining of its chunk loop (Triton's num_stages). NOTE: at d_k = d_v = 128 and chunks of
    32, Triton's default of 3 stages asked for 336 KB of shared memory, over an H200's 227 KB."""
    batch, num_tokens, num_v, dv = value_BTNV.shape
    dk = key_BTNK.shape[-1]
    if precision is None:
        precision = "ieee" if value_BTNV.dtype == torch.float32 else "tf32"
    assert precision in ("ieee", "tf32"), precision
    num_warps = 4 if chunk <= 32 else 8  # the chunk kernel's C x d tiles
    query_BTNK, key_BTNK, value_BTNV, beta_BTN, log_decay_BTN = (
        t if t.stride(-1) == 1 else t.contiguous()
        for t in (query_BTNK, key_BTNK, value_BTNV, beta_BTN, log_decay_BTN)
    )
    num_chunks = triton.cdiv(num_tokens, chunk)
    scratch = (batch * num_v * num_chunks * chunk,)
    w = value_BTNV.new_empty((*scratch, dk), dtype=torch.float32)
    u = value_BTNV.new_empty((*scratch, dv), dtype=torch.float32)
    p = value_BTNV.new_empty((*scratch, chunk), dtype=torch.float32)
    g = value_BTNV.new_empty(scratch, dtype=torch.float32)
    group = num_v // key_BTNK.shape[2]
    _chunk_kernel[(batch * num_v, num_chunks)](
        query_BTNK, key_BTNK, value_BTNV, beta_BTN, log_decay_BTN, w, u, p, g,
        query_BTNK.stride(0), query_BTNK.stride(1), query_BTNK.stride(2),
        key_BTNK.stride(0), key_BTNK.stride(1), key_BTNK.stride(2),
        value_BTNV.stride(0), value_BTNV.stride(1), value_BTNV.stride(2),
        beta_BTN.stride(0), beta_BTN.stride(1),
        log_decay_BTN.stride(0), log_decay_BTN.stride(1),
        num_tokens, num_v, num_chunks,
        GROUP=group, C=chunk, DK=dk, DV=dv, IEEE=precision == "ieee", num_warps=num_warps,
    )  # fmt: skip
    out = value_BTNV.new_empty((batch, num_tokens, num_v, dv), dtype=torch.float32)
    state = value_BTNV.new_empty((batch, num_v, dk, dv), dtype=torch.float32)
    block_v = min(block_v, dv)
    _scan_kernel[(batch * num_v, dv // block_v)](
        query_BTNK, key_BTNK, w, u, p, g, out, state,
        query_BTNK.stride(0), query_BTNK.stride(1), query_BTNK.stride(2),
        key_BTNK.stride(0), key_BTNK.stride(1), key_BTNK.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        num_tokens, num_v, num_chunks,
        GROUP=group, C=chunk, DK=dk, DV=dv, BV=block_v, IEEE=precision == "ieee",
        num_stages=scan_stages,
    )  # fmt: skip
    return out, state


def chunked_gated_delta_torch(
    query_BTNK: torch.Tensor,
    key_BTNK: torch.Tensor,
    value_BTNV: torch.Tensor,
    beta_BTN: torch.Tensor,
    log_decay_BTN: torch.Tensor,
    *,
    chunk: int = CHUNK,
    initial_state_BNKV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_gated_delta`'s arithmetic in PyTorch, in fp32 (the CPU engine's prefill): the
    chunks' triangular systems in one batched solve, then a loop over the chunks for the state.
    Same arguments and returns; `initial_state_BNKV` (not written) continues a state instead of
    starting from zero (a prompt's later chunk).

    The operands are laid out chunk-major, (chunks, B * N, C, ...), so that each step of the loop
    takes contiguous slices that its batched matmuls read in place, and the state is updated in
    place. Sliced from (B, N, chunks, ...) instead, every matmul operand was copied first: on 2
    CPU cores one layer of the small Qwen3.5 checkpoint (8 value heads of 64) took 2.7-2.8 ms for
    one 160-token prompt and 100-118 ms for 32 of 256 tokens, and 2.1-2.2 and 82-103 chunk-major
    (three runs each). `benchmarks/cpu_delta_rule.py` compares it with transformers' rule."""
    batch, num_tokens, num_v, dv = value_BTNV.shape
    dk = key_BTNK.shape[-1]
    group = num_v // key_BTNK.shape[2]
    pad = -num_tokens % chunk
    num_chunks = (num_tokens + pad) // chunk

    def chunks(x: torch.Tensor, heads_repeat: int = 1) -> torch.Tensor:
        """(B, T, N, ...) -> (chunks, B * N, C, ...) fp32, zero-padded to whole chunks."""
        x = x.float()
        if pad:
            x = torch.nn.functional.pad(x, (0, 0) * (x.ndim - 3) + (0, 0, 0, pad))
        x = x.reshape(batch, num_chunks, chunk, *x.shape[2:])
        if heads_repeat > 1:
            x = x.repeat_interleave(heads_repeat, dim=3)
        x = x.permute(1, 0, 3, 2, *range(4, x.ndim))  # (chunks, B, N, C, ...)
        return x.reshape(num_chunks, batch * num_v, chunk, *x.shape[4:])

    q, k = chunks(query_BTNK, group), chunks(key_BTNK, group)
    v, beta, cum = chunks(value_BTNV), chunks(beta_BTN), chunks(log_decay_BTN).cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay_CC = (cum[..., :, None] - cum[..., None, :]).masked_fill_(upper, float("-inf")).exp_()
    # (I + A) X = [beta V | beta Γ K] with A strictly lower: unitriangular ignores A's diagonal.
    a = (k @ k.transpose(-1, -2)).mul_(decay_CC).mul_(beta[..., :, None])
    rhs = torch.cat([v * beta[..., None], k * (beta * cum.exp())[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :dv], solved[..., dv:]
    qk = (q @ k.transpose(-1, -2)).mul_(decay_CC)
    q_decayed = q * cum.exp()[..., None]
    last = cum[..., -1:]
    k_to_end_T = (k * (last - cum).exp()[..., None]).transpose(-1, -2).contiguous()
    chunk_decay = last.exp()[..., None]  # (chunks, B * N, 1, 1)
    if initial_state_BNKV is None:
        state = q.new_zeros((batch * num_v, dk, dv))
    else:
        state = initial_state_BNKV.float().reshape(batch * num_v, dk, dv).clone()
    out = q.new_empty((num_chunks, batch * num_v, chunk, dv))
    for c in range(num_chunks):
        delta = torch.baddbmm(u[c], w[c], state, alpha=-1)
        torch.bmm(q_decayed[c], state, out=out[c])
        out[c].baddbmm_(qk[c], delta)
        state.mul_(chunk_decay[c]).baddbmm_(k_to_end_T[c], delta)
    out = out.reshape(num_chunks, batch, num_v, chunk, dv).permute(1, 0, 3, 2, 4)
    out = out.reshape(batch, num_chunks * chunk, num_v, dv)[:, :num_tokens]
    return out, state.reshape(batch, num_v, dk, dv)
