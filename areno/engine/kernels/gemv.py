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
        X, W, Bias, Y, N, K, stride_xm, stride_wn, stride_ym,
        M: tl.constexpr, M_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
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
        tl.store(
            Y + offs_m[:, None] * stride_ym + offs_n[None, :],
            acc.to(Y.dtype.element_ty),
            mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
        )


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


def gemv(
    x_MK: torch.Tensor,
    weight_NK: torch.Tensor,
    bias_N: torch.Tensor | None = None,
    options: dict | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias for a few rows x (M, K) (a benchmark's; the engine's have one) with
    `launch_options` (or `options`). The weight's rows must be contiguous."""
    rows, in_features = x_MK.shape
    out_features = weight_NK.shape[0]
    x_MK = x_MK if x_MK.stride(-1) == 1 else x_MK.contiguous()
    y = x_MK.new_empty(rows, out_features)
    options = options or launch_options(out_features, in_features)
    _gemv_kernel[(triton.cdiv(out_features, options["BLOCK_N"]),)](
        x_MK, weight_NK, weight_NK if bias_N is None else bias_N, y,
        out_features, in_features, x_MK.stride(0), weight_NK.stride(0), y.stride(0),
        M=rows, M_PAD=triton.next_power_of_2(rows), HAS_BIAS=bias_N is not None, **options,
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
