"""The gated delta rule's forward and backward as the trainer runs them (transformers' Qwen3.5
linear-attention layers): transformers' own PyTorch implementation, which it falls back to, against
flash-linear-attention's Triton kernels, which it takes when `fla` is importable. The inference
engine has kernels of its own (areno/engine/kernels); the trainer's pass has none.

Per implementation: the median milliseconds of one layer's forward + backward on `--tokens`
tokens a row (random q, k, v, gates and betas, the Qwen3.5-2B shape's 16 heads of 128 by
default), and that times `--layers` (the 2B shape's 18 linear-attention layers), the share of a
training pass it stands for; and the largest difference of fla's outputs and input gradients from
the reference's.

    python benchmarks/gated_delta_train.py --device cuda                 # needs fla for its row
    python benchmarks/gated_delta_train.py --device cpu --tokens 512     # reference only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_workloads import median_seconds, write_results  # noqa: E402


def inputs(args, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    rows, length, heads, dim = args.rows, args.tokens, args.heads, args.head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    return {
        "query": rand(rows, length, heads, dim),
        "key": rand(rows, length, heads, dim),
        "value": rand(rows, length, heads, dim),
        # log decay in (-inf, 0) and write strength in (0, 1), as the layer makes them
        "g": -torch.nn.functional.softplus(rand(rows, length, heads)),
        "beta": torch.sigmoid(rand(rows, length, heads)),
    }


def implementations() -> dict:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    reference = getattr(qwen.torch_chunk_gated_delta_rule, "__wrapped__", None)
    found = {"transformers (PyTorch)": reference or qwen.torch_chunk_gated_delta_rule}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as error:
        print(f"flash-linear-attention: not importable ({error}); its row is left out")
    else:
        found["flash-linear-attention (Triton)"] = chunk_gated_delta_rule
    return found


def run(fn, tensors: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = {k: v.detach().requires_grad_(True) for k, v in tensors.items()}
    # positional q, k, v: transformers names them query/key/value, fla q/k/v
    out, _ = fn(
        leaves["query"],
        leaves["key"],
        leaves["value"],
        g=leaves["g"],
        beta=leaves["beta"],
        use_qk_l2norm_in_kernel=True,
    )
    out.float().square().mean().backward()
    return out.detach(), [leaves[k].grad for k in ("query", "key", "value")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/gated_delta_train.json")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    tensors = inputs(args, device, dtype)
    found = implementations()
    results, reference = {}, None
    for name, fn in found.items():
        out, grads = run(fn, tensors)  # first call: compiles, autotunes
        seconds = median_seconds(lambda fn=fn: run(fn, tensors), device, args.repeats)
        row = {"layer_ms": seconds * 1e3, "layers_ms": seconds * 1e3 * args.layers}
        if reference is None:
            reference = (out, grads)
        else:
            row["max_abs_diff_out"] = (out.float() - reference[0].float()).abs().max().item()
            row["max_abs_diff_grad"] = max(
                (a.float() - b.float()).abs().max().item()
                for a, b in zip(grads, reference[1], strict=True)
            )
        results[name] = row
    print(
        f"\ngated delta rule, forward + backward: {args.rows} x {args.tokens} tokens, "
        f"{args.heads} heads of {args.head_dim}, {args.dtype}, {device}"
    )
    print(
        f"{'implementation':<34} {'ms a layer':>11} {f'x {args.layers} layers':>14} {'max diff':>10}"
    )
    for name, row in results.items():
        diff = max(row.get("max_abs_diff_out", 0.0), row.get("max_abs_diff_grad", 0.0))
        print(f"{name:<34} {row['layer_ms']:>11.2f} {row['layers_ms']:>14.1f} {diff:>10.3g}")
    write_results(args.out, vars(args), results)


if __name__ == "__main__":
    main()
