"""A decode step's products at 1-8 rows: cuBLAS against a Triton matrix-vector kernel and
inductor's own reduction, each against the copy rate of its weight.

At one decoding row every linear layer reads its whole weight to produce one output row, so its
floor is the weight's bytes at the device's copy rate. On an H100 the Qwen3-1.7B shape's four
products a layer took 1.28 ms a step against 0.94 ms of reads, and one of them went through
cuBLAS's split-K path plus a separate reduction kernel (docs/performance.md, "Where a step's time
goes"). This measures, product by product, what each way reaches:
- cublas:   `F.linear`, as the compiled decode step calls it with `one_row_gemv` off;
- areno:    the engine's matrix-vector kernel (areno/engine/kernels/gemv.py: one program per
            block of output features, each looping over the whole input dimension) at the
            launch the engine picks for the product (`launch_options`);
- triton:   the same kernel at the fastest of `--configs` launch options;
- inductor: `torch.compile` of the product written as a broadcast multiply and a sum, which
            inductor turns into one reduction kernel (and could fuse a norm into).
Each product is timed inside a CUDA graph that cycles through enough copies of its weight to
leave no copy in the L2 cache (the model's layers never reread a weight within a step). Alone,
cuBLAS may choose other kernels than inside the compiled step (`profile_decode.py` shows those).
`--fused` instead times the one-row layer's fused products (areno/engine/layers/row_layer.py)
at one row against the plain kernel on the same weight: `qkv` with its input norm
(`norm_row_linear`), `gate_up` with the residual add, the norm and the activation
(`add_norm_row_linear`, gated), `down` with the residual add (`residual_row_linear`), each at the
launch the engine picks (`fused_launch_options`) and at the fastest of a sweep of launches.
Fixed seed; prints a table and writes JSON.

    python benchmarks/decode_gemv.py --model qwen3-1.7b qwen3-8b --rows 1 4
    python benchmarks/decode_gemv.py --model qwen3-1.7b qwen3-8b --fused
    TRITON_INTERPRET=1 python benchmarks/decode_gemv.py --check   # CPU: the kernel's arithmetic
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).parent))
from engine_workloads import copy_bandwidth_gb_s  # noqa: E402

from areno.engine.kernels.gemv import (  # noqa: E402
    add_norm_gemv,
    fused_launch_options,
    gemv,
    launch_options,
    norm_gemv,
    residual_gemv,
)

# (hidden, intermediate, query heads, key / value heads, head dim, vocabulary) of each shape.
SHAPES = {
    "qwen3-1.7b": (2048, 6144, 16, 8, 128, 151936),
    "qwen3-8b": (4096, 12288, 32, 8, 128, 151936),
}


def products(model: str) -> dict[str, tuple[int, int]]:
    """(out features, in features) of one layer's fused products and the LM head."""
    hidden, inter, heads, kv_heads, dim, vocab = SHAPES[model]
    return {
        "qkv": ((heads + 2 * kv_heads) * dim, hidden),
        "o": (hidden, heads * dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (vocab, hidden),
    }


def reduction_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float()[:, None, :] * w.float()[None]).sum(-1).to(x.dtype)


def configs(grid: str) -> list[dict]:
    if grid == "small":
        sizes = [(4, 512, 4, 3), (8, 256, 4, 4), (8, 512, 4, 3), (16, 256, 4, 3), (16, 128, 4, 4)]
    else:
        sizes = [
            (bn, bk, warps, stages)
            for bn, bk, warps, stages in itertools.product(
                (2, 4, 8, 16), (256, 512, 1024), (4, 8), (2, 4)
            )
            if bn * bk <= 8192
        ]
    return [
        {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
        for bn, bk, warps, stages in sizes
    ]


def graph_seconds(fn, xs: torch.Tensor, weights: list[torch.Tensor], repeats: int) -> float:
    """Seconds a call of `fn(x, w)`, cycling through `weights`, captured in a CUDA graph."""
    fn(xs, weights[0])  # compile / warm up outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for w in weights:
            fn(xs, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(xs, w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(weights))
    return sorted(times)[len(times) // 2]


FUSED_PRODUCTS = ("qkv", "gate_up", "down")


def fastest(fn, launches: list[dict], x: torch.Tensor, weights: list[torch.Tensor]) -> dict | None:
    """The launch of `launches` under which `fn(x, w, launch)` runs fastest (a quick timing of
    3 replays each); None where the GPU takes none (registers, shared memory)."""
    best = None
    for launch in launches:
        try:
            fn_of_launch = lambda x, w, c=launch: fn(x, w, c)  # noqa: E731
            seconds = graph_seconds(fn_of_launch, x, weights, 3)
        except Exception:  # noqa: BLE001 - a launch the GPU cannot take
            continue
        if best is None or seconds < best[0]:
            best = (seconds, launch)
    return None if best is None else best[1]


def _gives(want: torch.Tensor, x: torch.Tensor, w: torch.Tensor, launch: dict) -> bool:
    """Whether the kernel at `launch` runs and gives `want` (to bf16's tolerance)."""
    try:
        return torch.allclose(gemv(x, w, None, launch).float(), want, rtol=2e-2, atol=2e-2)
    except Exception:  # noqa: BLE001 - a launch the GPU cannot take
        return False


def fused_configs() -> list[dict]:
    """The launches `--fused` sweeps: 1-8 output features a program (of a gate and of an up
    each, for `gate_up`), 512 or 1024 inputs a block, 4 or 8 warps, 2 or 4 stages."""
    return [
        {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
        for bn, bk, warps, stages in itertools.product((1, 2, 4, 8), (512, 1024), (4, 8), (2, 4))
    ]


def fused_rows(model: str, bandwidth: float, cycle_mib: int, repeats: int) -> list[dict]:
    """One row a fused product of `model`'s layer: the plain kernel at the engine's launch, the
    fused one at the engine's launch and at its fastest in the sweep, in us."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    for name in FUSED_PRODUCTS:
        n, k = products(model)[name]
        copies = max(2, -(-(cycle_mib << 20) // (n * k * 2)))
        weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        a = torch.randn(1, 1, k, device=device, dtype=dtype)
        residual = torch.randn(1, 1, n if name == "down" else k, device=device, dtype=dtype)
        norm_weight = torch.rand(k, device=device, dtype=dtype)

        def fused(x, w, options=None, name=name, residual=residual, norm_weight=norm_weight):
            if name == "qkv":
                return norm_gemv(x, norm_weight, 1e-6, 0.0, w, options)
            if name == "gate_up":
                return add_norm_gemv(x, residual, norm_weight, 1e-6, 0.0, w, True, options)[0]
            return residual_gemv(x, w, residual, options)

        row = {"model": model, "product": name, "rows": 1, "n": n, "k": k}
        row["floor_us"] = n * k * 2 / bandwidth / 1e3
        row["plain_us"] = 1e6 * graph_seconds(
            lambda x, w: gemv(x.view(1, -1), w), a, weights, repeats
        )
        row["fused_us"] = 1e6 * graph_seconds(fused, a, weights, repeats)
        row["fused_config"] = (
            launch_options(n, k) if name == "down" else
            fused_launch_options(n // 2 if name == "gate_up" else n, k)
        )  # fmt: skip
        best = fastest(fused, fused_configs(), a, weights)
        if best is not None:
            fn = lambda x, w, c=best: fused(x, w, c)  # noqa: E731
            row["fused_best_us"] = 1e6 * graph_seconds(fn, a, weights, repeats)
            row["fused_best_config"] = best
        rows.append(row)
        print(
            f"{model:12}{name:>9}{row['floor_us']:>8.1f}{row['plain_us']:>9.1f}"
            f"{row['fused_us']:>9.1f}{row.get('fused_best_us', float('nan')):>9.1f}"
            f"{str(best or '-'):>60}"
        )
        del weights
        torch.cuda.empty_cache()
    return rows


def check() -> None:
    """The kernel against F.linear (under TRITON_INTERPRET=1 on CPU, or on a GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    for m, n, k in [(1, 48, 96), (3, 40, 200), (8, 64, 64)]:
        x = torch.randn(m, k, generator=gen).to(device)
        w = torch.randn(n, k, generator=gen).to(device)
        for config in configs("small")[:2]:
            got = gemv(x, w, None, {**config, "BLOCK_K": 32})
            torch.testing.assert_close(got, F.linear(x, w), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(reduction_gemv(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
    print("decode_gemv: the kernel matches F.linear")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["qwen3-1.7b"], choices=sorted(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1])
    parser.add_argument("--configs", default="full", choices=["full", "small"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--cycle-mib", type=int, default=512, help="weight copies per product")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="check the kernel's arithmetic only")
    parser.add_argument(
        "--fused", action="store_true", help="the one-row layer's fused products instead"
    )
    parser.add_argument("--out", default="benchmarks/results/decode_gemv.json")
    args = parser.parse_args()
    if args.check:
        check()
        return
    torch.manual_seed(args.seed)
    device = torch.device("cuda")
    dtype = torch.bfloat16
    bandwidth = copy_bandwidth_gb_s(device, 1 << 30)
    # one graph per product and row count: 20 in all, past dynamo's default limit of 8
    torch._dynamo.config.recompile_limit = 64
    compiled = torch.compile(reduction_gemv, dynamic=False)
    results = []
    print(f"{torch.cuda.get_device_name()}, copy rate {bandwidth:.0f} GB/s; us a product")
    if args.fused:
        print(f"{'model':12}{'product':>9}{'floor':>8}{'plain':>9}{'fused':>9}{'best':>9}"
              f"{'best fused config':>60}")  # fmt: skip
        for model in args.model:
            results += fused_rows(model, bandwidth, args.cycle_mib, args.repeats)
    plain_models = [] if args.fused else args.model
    if plain_models:
        print(f"{'model':12}{'product':>9}{'rows':>6}{'floor':>8}{'cublas':>9}{'areno':>9}"
              f"{'triton':>9}{'inductor':>10}{'best triton config':>34}")  # fmt: skip
    for model in plain_models:
        for name, (n, k) in products(model).items():
            size = n * k * 2
            copies = max(2, -(-(args.cycle_mib << 20) // size))
            weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
            for m in args.rows:
                x = torch.randn(m, k, device=device, dtype=dtype)
                want = F.linear(x, weights[0]).float()
                row = {"model": model, "product": name, "rows": m, "n": n, "k": k}
                row["floor_us"] = size / bandwidth / 1e3
                row["cublas_us"] = 1e6 * graph_seconds(F.linear, x, weights, args.repeats)
                right = [c for c in configs(args.configs) if _gives(want, x, weights[0], c)]
                best = fastest(lambda x, w, c: gemv(x, w, None, c), right, x, weights)
                if best is not None:
                    fn = lambda x, w, c=best: gemv(x, w, None, c)  # noqa: E731
                    row["triton_us"] = 1e6 * graph_seconds(fn, x, weights, args.repeats)
                    row["triton_config"] = best
                # The launch the engine picks (areno/engine/kernels/gemv.py: launch_options).
                row["areno_us"] = 1e6 * graph_seconds(
                    lambda x, w: gemv(x, w), x, weights, args.repeats
                )
                row["areno_config"] = launch_options(n, k)
                try:
                    row["inductor_us"] = 1e6 * graph_seconds(compiled, x, weights, args.repeats)
                except Exception as error:  # noqa: BLE001
                    row["inductor_error"] = f"{type(error).__name__}: {error}"[:200]
                results.append(row)
                cells = [
                    f"{row.get(key, float('nan')):>9.1f}"
                    for key in ("cublas_us", "areno_us", "triton_us")
                ]
                print(
                    f"{model:12}{name:>9}{m:>6}{row['floor_us']:>8.1f}{''.join(cells)}"
                    f"{row.get('inductor_us', float('nan')):>10.1f}"
                    f"{str(best or '-'):>34}"
                )
            del weights
            torch.cuda.empty_cache()
    for model in plain_models:
        for m in args.rows:
            layer = [r for r in results if r["model"] == model and r["rows"] == m
                     and r["product"] != "lm_head"]  # fmt: skip
            sums = {key: sum(r.get(key, 0.0) for r in layer) for key in
                    ("floor_us", "cublas_us", "areno_us", "triton_us", "inductor_us")}  # fmt: skip
            print(f"{model} {m} row(s), a layer's four products: floor {sums['floor_us']:.1f} us, "
                  f"cublas {sums['cublas_us']:.1f}, areno's launch {sums['areno_us']:.1f}, "
                  f"best triton {sums['triton_us']:.1f}, "
                  f"inductor {sums['inductor_us']:.1f}")  # fmt: skip
    meta = {
        "machine": platform.platform(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_bandwidth_gb_s": bandwidth,
        "seed": args.seed,
        "repeats": args.repeats,
        "cycle_mib": args.cycle_mib,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
