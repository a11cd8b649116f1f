"""A linear layer's product of one row (a decode step of one sequence) as a matrix-vector kernel.

At one row a product reads its whole weight to make one output row: its floor is the weight's
bytes at the copy rate. cuBLAS takes such shapes through GEMM kernels, some split over the input
dimension with a second kernel to reduce the splits (the Qwen3-8B shape's o and down products, on
the H100 and the H200). This kernel gives each program a few output features and loops over the
whole input: one launch, no reduction. On an H100 (bf16, each product alone in a CUDA graph,
`benchmarks/decode_gemv.py`) it ran every product of the Qwen3-1.7B and Qwen3-8B shapes at one
row faster than cuBLAS alone, 137.6 against 154.7 us a layer of the 8B shape (floor 129.8); at
four rows it loses, so only one row takes it. Inside that shape's compiled, captured decode step
at one row the step took 6.31 ms against 6.99 with cuBLAS (docs/performance.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areno.engine.kernels import triton, use_triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _gemv_kernel(
        X, W, Bias, R, Y, N, K, stride_xm, stride_wn, stride_ym,
        M: tl.constexpr, M_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # `HAS_RESIDUAL`: y = r + x @ W.T, the product rounded to the activations' dtype before
        # the add, as the unfused operators round it (R strided as Y).
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, M_PAD)
        acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
        for start in range(0, K, BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            w = tl.load(
                W + offs_n[:, None] * stride_wn + offs_k[None, :],
                mask=(offs_n[:, None] < N) & (offs_k[None, :] < K),
                other=0.0,
            )
            x = tl.load(
                X + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=(offs_m[:, None] < M) & (offs_k[None, :] < K),
                other=0.0,
            )
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        in_y = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if HAS_RESIDUAL:
            acc = acc.to(Y.dtype.element_ty).to(tl.float32)
            acc += tl.load(
                R + offs_m[:, None] * stride_ym + offs_n[None, :], mask=in_y, other=0.0
            ).to(tl.float32)
        tl.store(
            Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=in_y
        )

    @triton.jit
    def _add_norm_gemv_kernel(
        A, R, G, W, Y, H, N, K, eps, offset, stride_wn,
        ADD: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # y = W @ rms_norm(a + r) (`ADD`; else of a): the sum rounded to the activations' dtype
        # (program 0 stores it in H), each input scaled by its norm weight (plus `offset`) on
        # the way in and the row's 1 / rms applied to the finished sums, so one pass over the
        # input does both. `GATED`: W's rows are a gate's N then an up's N, and a program takes
        # output n of both, so it can store silu(gate) * up: N outputs.
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = offs_n < N
        acc = tl.zeros([BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_N], tl.float32)
        squares = tl.zeros([BLOCK_K], tl.float32)
        for start in range(0, K, BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            in_k = offs_k < K
            x = tl.load(A + offs_k, mask=in_k, other=0.0).to(tl.float32)
            if ADD:
                x += tl.load(R + offs_k, mask=in_k, other=0.0).to(tl.float32)
                x = x.to(H.dtype.element_ty)
                tl.store(H + offs_k, x, mask=in_k & (pid == 0))
                x = x.to(tl.float32)
            squares += x * x
            g = tl.load(G + offs_k, mask=in_k, other=0.0).to(tl.float32) + offset
            xg = (x * g)[None, :]
            rows = W + offs_n[:, None] * stride_wn + offs_k[None, :]
            mask = in_n[:, None] & in_k[None, :]
            acc += tl.sum(tl.load(rows, mask=mask, other=0.0).to(tl.float32) * xg, axis=1)
            if GATED:
                up = tl.load(rows + N * stride_wn, mask=mask, other=0.0).to(tl.float32)
                acc_up += tl.sum(up * xg, axis=1)
        scale = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
        out = (acc * scale).to(Y.dtype.element_ty)
        if GATED:
            # Rounded as the unfused operators round: gate and up, the activation, the product.
            gate = out.to(tl.float32)
            act = (gate * tl.sigmoid(gate)).to(Y.dtype.element_ty).to(tl.float32)
            up = (acc_up * scale).to(Y.dtype.element_ty).to(tl.float32)
            out = (act * up).to(Y.dtype.element_ty)
        tl.store(Y + offs_n, out, mask=in_n)


def launch_options(out_features: int, in_features: int) -> dict:
    """The kernel's launch for a weight of these sizes: 1024 input features a block (fewer for a
    narrower input), 4 output features a program from 4096 outputs on (2 below, which leaves the
    GPU more programs), four warps, four pipelining stages over an input of 4096 or more. Of the
    sweep `benchmarks/decode_gemv.py` runs (2-16 outputs a program, 256-1024 inputs a block, 4 or
    8 warps, 2 or 4 stages) the H100's fastest launch of every product of the Qwen3-1.7B and
    Qwen3-8B shapes at one row took 1024 inputs a block and four warps, and 2 or 4 outputs."""
    return {
        "BLOCK_N": 4 if out_features >= 4096 else 2,
        "BLOCK_K": min(1024, max(16, triton.next_power_of_2(in_features))),
        "num_warps": 4,
        "num_stages": 4 if in_features >= 4096 else 2,
    }


def fused_launch_options(out_features: int, in_features: int) -> dict:
    """A launch of the norm's kernel (`add_norm_row_linear`, `norm_row_linear`): `launch_options`
    with 2 output features a program (of a gated product: 2 of the gate, 2 of the up). Every
    program works its whole input over (the add, the norm's weight and squares) beside its rows
    of the weight; on an H100 the fastest of 32 launches of each fused product of the 1.7B and 8B
    shapes took 2 a program, or 4 within 1 us (`decode_gemv.py --fused`,
    docs/performance.md), where 8 (4 and 4) cost 1-4 us a product more."""
    return launch_options(out_features, in_features) | {"BLOCK_N": 2}


def gemv(
    x_MK: torch.Tensor,
    weight_NK: torch.Tensor,
    bias_N: torch.Tensor | None = None,
    options: dict | None = None,
    residual_MN: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias (+ residual, added to the rounded product) for a few rows x (M, K)
    (a benchmark's; the engine's have one) with `launch_options` (or `options`). The weight's
    rows must be contiguous."""
    rows, in_features = x_MK.shape
    out_features = weight_NK.shape[0]
    x_MK = x_MK if x_MK.stride(-1) == 1 else x_MK.contiguous()
    y = x_MK.new_empty(rows, out_features)
    if residual_MN is not None:
        residual_MN = residual_MN.reshape(rows, out_features).contiguous()
    options = options or launch_options(out_features, in_features)
    _gemv_kernel[(triton.cdiv(out_features, options["BLOCK_N"]),)](
        x_MK, weight_NK, weight_NK if bias_N is None else bias_N,
        y if residual_MN is None else residual_MN, y,
        out_features, in_features, x_MK.stride(0), weight_NK.stride(0), y.stride(0),
        M=rows, M_PAD=triton.next_power_of_2(rows), HAS_BIAS=bias_N is not None,
        HAS_RESIDUAL=residual_MN is not None, **options,
    )  # fmt: skip
    return y


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel computes `F.linear(x, weight)`: one row (every dimension of x but the
    last is 1), x and the weight of one floating dtype, the weight a plain 2-D tensor with
    contiguous rows, where the engine's kernels run (`use_triton`)."""
    return (
        x.numel() == x.shape[-1]
        and x.dtype == weight.dtype
        and weight.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and weight.dim() == 2
        and weight.stride(-1) == 1
        and use_triton(weight)
    )


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the matrix-vector kernel where it `takes` the
    product (decided per call: a captured graph keeps the kernel its shapes chose)."""
    if not takes(x, weight):
        return F.linear(x, weight, bias)
    y = gemv(x.reshape(1, -1), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


# NOTE: through `torch.library.Library`, as `areno::packed_linear` (layers/cpu_linear.py), so a
# compiled step calls the kernel without a graph break and captures what each row count chose.
_LIBRARY = torch.library.Library("areno", "FRAGMENT")
_LIBRARY.define("row_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.impl("row_linear", row_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("areno::row_linear")
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


row_linear_op = torch.ops.areno.row_linear.default


# The products of a decoder layer at one row with the operators around them folded in: the norm
# before the token mixer's input projections; the residual add and the norm before `gate_up`, and
# the activation after it; the residual add after `down`. Each leaves a kernel launch a layer out
# of a one-row decode step (areno/engine/layers/row_layer.py).


def add_norm_row_linear(
    a: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    offset: float,
    weight: torch.Tensor,
    gated: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight @ rms_norm(a + residual), a + residual) for one row, the norm's weight plus
    `offset` (1 for the norms that scale by 1 + weight); `gated`: weight is a gate's rows then an
    up's, and the first is silu(gate) * up. One kernel; the reference where the kernels do not
    run."""
    if not use_triton(weight):
        return add_norm_linear_reference(a, residual, norm_weight, eps, offset, weight, gated)
    return add_norm_gemv(a, residual, norm_weight, eps, offset, weight, gated)


def add_norm_gemv(a, residual, norm_weight, eps, offset, weight, gated, options=None):
    summed = torch.empty_like(a)
    out = _norm_gemv(a, residual, summed, norm_weight, eps, offset, weight, gated, options)
    return out, summed


def norm_row_linear(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, offset: float, weight: torch.Tensor
) -> torch.Tensor:
    """weight @ rms_norm(x) for one row (the norm's weight plus `offset`), in one kernel; the
    reference where the kernels do not run."""
    if not use_triton(weight):
        return norm_linear_reference(x, norm_weight, eps, offset, weight)
    return norm_gemv(x, norm_weight, eps, offset, weight)


def norm_gemv(x, norm_weight, eps, offset, weight, options=None):
    return _norm_gemv(x, None, None, norm_weight, eps, offset, weight, False, options)


def _norm_gemv(x, residual, summed, norm_weight, eps, offset, weight, gated, options=None):
    # `options`: a launch of a benchmark's sweep (benchmarks/decode_gemv.py --fused) in place of
    # `fused_launch_options`.
    in_features = x.shape[-1]
    out_features = weight.shape[0] // 2 if gated else weight.shape[0]
    x = x.contiguous()
    out = x.new_empty(*x.shape[:-1], out_features)
    options = options or fused_launch_options(out_features, in_features)
    add = residual is not None
    _add_norm_gemv_kernel[(triton.cdiv(out_features, options["BLOCK_N"]),)](
        x, residual.contiguous() if add else x, norm_weight, weight, out,
        summed if add else x, out_features, in_features, eps, offset, weight.stride(0),
        ADD=add, GATED=gated, **options,
    )  # fmt: skip
    return out


def residual_row_linear(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    """residual + weight @ x for one row, in one kernel; the reference where the kernels do not
    run."""
    if not use_triton(weight):
        return residual_linear_reference(x, weight, residual)
    return residual_gemv(x, weight, residual)


def residual_gemv(x, weight, residual, options=None):
    return gemv(x.reshape(1, -1), weight, None, options, residual).view_as(residual)


def norm_linear_reference(x, norm_weight, eps, offset, weight):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return F.linear((normed * (norm_weight.float() + offset)).to(x.dtype), weight)


def add_norm_linear_reference(a, residual, norm_weight, eps, offset, weight, gated):
    summed = a + residual
    out = norm_linear_reference(summed, norm_weight, eps, offset, weight)
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out, summed


def residual_linear_reference(x, weight, residual):
    return residual + F.linear(x, weight)


_LIBRARY.define(
    "add_norm_row_linear(Tensor a, Tensor residual, Tensor norm_weight, float eps, float offset,"
    " Tensor weight, bool gated) -> (Tensor, Tensor)"
)
_LIBRARY.impl("add_norm_row_linear", add_norm_row_linear, "CompositeExplicitAutograd")
_LIBRARY.define(
    "norm_row_linear(Tensor x, Tensor norm_weight, float eps, float offset, Tensor weight)"
    " -> Tensor"
)
_LIBRARY.impl("norm_row_linear", norm_row_linear, "CompositeExplicitAutograd")
_LIBRARY.define("residual_row_linear(Tensor x, Tensor weight, Tensor residual) -> Tensor")
_LIBRARY.impl("residual_row_linear", residual_row_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("areno::add_norm_row_linear")
def _(a, residual, norm_weight, eps, offset, weight, gated):
    out_features = weight.shape[0] // 2 if gated else weight.shape[0]
    return a.new_empty((*a.shape[:-1], out_features)), torch.empty_like(a)


@torch.library.register_fake("areno::norm_row_linear")
def _(x, norm_weight, eps, offset, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("areno::residual_row_linear")
def _(x, weight, residual):
    return torch.empty_like(residual)


add_norm_row_linear_op = torch.ops.areno.add_norm_row_linear.default
norm_row_linear_op = torch.ops.areno.norm_row_linear.default
residual_row_linear_op = torch.ops.areno.residual_row_linear.default
