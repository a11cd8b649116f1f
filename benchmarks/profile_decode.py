"""Where one decode step of the engine spends its time, by operator class.

Fills every slot of a `ModelRunner` with a random prompt, warms the decode step up (compiling and
capturing it where the engine would), then, for each of `--rows` (the first that many slots
decoding), times steps and profiles a few with torch.profiler, and prints: the step time, each
class's share (GEMM, attention, linear-attention recurrence, copies, other elementwise), the top
operators or kernels, and the byte floor of the step (`engine_workloads.ByteFloor`: the weights,
the rows' cached keys and values, their linear-attention states, at the measured copy
bandwidth; the weights' products instead of their reads where those take longer, at the measured
matrix-product rate). On CUDA the shares are of GPU kernel time; on CPU of operator self time. JSON goes
to --out.

    python benchmarks/profile_decode.py --model small                        # CPU, fp32, 16 rows
    python benchmarks/profile_decode.py --model qwen3-8b --rows 64 256       # GPU, bf16
    python benchmarks/profile_decode.py --model qwen3.5-2b --linear-state-dtype bfloat16
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from engine_workloads import (  # noqa: E402
    MODELS,
    ByteFloor,
    copy_bandwidth_gb_s,
    load_small,
    matmul_tflops,
    random_model,
    weight_bytes,
)

from areno.engine.runner.model_runner import ModelRunner  # noqa: E402
from areno.processing.types import PromptInputs  # noqa: E402

# Operator / kernel name fragments of each class, first match wins (lower case).
CLASSES = {
    "gemm": ("gemm", "linear", "mm", "matmul", "cutlass", "sm90_xmma", "nvjet", "addmm", "gemv"),
    # _split_kernel / _combine_kernel: the engine's split-key decode attention and its merge
    # (areno/engine/kernels/decode_attention.py).
    "attention": ("attention", "flash", "fmha", "sdpa", "softmax", "_split_kernel", "_combine"),
    "recurrence": ("gated_delta", "_chunk_kernel", "_scan_kernel", "delta_rule"),
    "copy": ("copy", "cat", "index", "scatter", "gather", "memcpy", "memset", "fill"),
}


def classify(name: str) -> str:
    lowered = name.lower()
    for cls, fragments in CLASSES.items():
        if any(f in lowered for f in fragments):
            return cls
    return "other"


def build(args: argparse.Namespace) -> torch.nn.Module:
    dtype = getattr(torch, args.dtype)
    if args.model == "small":
        return load_small(args.family, args.device, dtype)[0]
    return random_model(args.model, args.device, dtype)


def fill(runner: ModelRunner, args: argparse.Namespace, vocab: int) -> float:
    """Every slot prefilled with a random prompt of `args.prompt_len` tokens; ms per prompt."""
    generator = torch.Generator().manual_seed(args.seed)
    began = time.perf_counter()
    for slot in range(runner.num_slots):
        ids = torch.randint(10, vocab, (args.prompt_len,), generator=generator).tolist()
        runner.prefill(PromptInputs(ids, {}), [slot])
    _sync(runner)
    return (time.perf_counter() - began) / runner.num_slots * 1e3


def _sync(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def profile_steps(runner: ModelRunner, args: argparse.Namespace, rows: int) -> dict:
    """Warm-up, timed and profiled decode steps of the first `rows` slots. Every call decodes
    the same positions (the context stays `prompt_len`), so the rows' KV reads are the same."""
    on_cuda = runner.device.type == "cuda"
    slots = list(range(rows))
    token_ids = [5] * rows

    def step() -> None:
        runner.decode(slots, [args.prompt_len] * rows, token_ids)

    began = time.perf_counter()
    for _ in range(args.warmup):
        step()
    _sync(runner)
    warmup_s = time.perf_counter() - began
    began = time.perf_counter()
    for _ in range(args.steps):
        step()
    _sync(runner)
    step_ms = (time.perf_counter() - began) / args.steps * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        _sync(runner)
    events = prof.key_averages()
    totals: dict[str, float] = defaultdict(float)
    top = []
    for event in events:
        us = event.self_device_time_total if on_cuda else event.self_cpu_time_total
        if us <= 0 or (on_cuda and event.device_type != torch.autograd.DeviceType.CUDA):
            continue
        totals[classify(event.key)] += us / args.steps
        top.append((us / args.steps, event.count // args.steps, event.key))
    top.sort(reverse=True)
    return {
        "rows": rows,
        "step_ms": step_ms,
        "warmup_s": warmup_s,
        "profiled_ms_per_step": sum(totals.values()) / 1e3,
        "classes_ms": {k: v / 1e3 for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
        "top": [{"ms": us / 1e3, "calls": n, "name": name} for us, n, name in top[: args.top]],
    }


def print_result(result: dict, floor_ms: float) -> None:
    print(
        f"\n{result['rows']} rows, one-row gemv {result['gemv']}, fused layer "
        f"{result['row_layer']}: step {result['step_ms']:.2f} ms (profiled "
        f"{result['profiled_ms_per_step']:.2f}); byte floor {floor_ms:.2f} ms = "
        f"{floor_ms / result['step_ms']:.0%} of the step"
    )
    print(f"{'class':<12} {'ms/step':>8} {'share':>6}")
    for cls, ms in result["classes_ms"].items():
        print(f"{cls:<12} {ms:>8.2f} {ms / result['profiled_ms_per_step']:>6.0%}")
    print(f"\n{'ms/step':>8} {'calls':>6}  operator / kernel")
    for row in result["top"]:
        print(f"{row['ms']:>8.3f} {row['calls']:>6}  {row['name'][:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small", choices=MODELS)
    parser.add_argument("--family", default="qwen3_5", help="for --model small")
    parser.add_argument("--device", help="default: cuda for the GPU shapes, else cpu")
    parser.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        help="decoding rows, one profile each (default 64 on cuda, 16 on cpu)",
    )
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--graphs", default="auto")
    parser.add_argument("--compile", default="auto")
    parser.add_argument(
        "--fuse-projections", choices=["auto", "on", "off"], default="auto", help="auto: on CUDA"
    )
    parser.add_argument(
        "--one-row-gemv",
        nargs="+",
        choices=["auto", "on", "off"],
        default=["auto"],
        help="products of one row on the matrix-vector kernel (the engine's one_row_gemv; auto: "
        "on CUDA); several values "
        "profile the same rows once each, one runner after another",
    )
    parser.add_argument(
        "--row-layer",
        nargs="+",
        choices=["on", "off"],
        default=["off"],
        help="with the one-row kernel, a Qwen-style layer at one row with its norms, residual adds "
        "and activation folded into its products (the runner's row_layer); several values "
        "profile each with each --one-row-gemv value",
    )
    parser.add_argument(
        "--linear-state-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="stored dtype of linear-attention states (the engine's linear_state_dtype)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/profile_decode.json")
    args = parser.parse_args()
    args.device = args.device or ("cpu" if args.model == "small" else "cuda")
    on_cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    args.rows = args.rows or [64 if on_cuda else 16]
    torch.manual_seed(args.seed)

    model = build(args)
    vocab = min(model.config.get_text_config().vocab_size, 400)  # ids the tiny tokenizer knows
    results, prefill_ms = [], {}
    for gemv, row_layer in itertools.product(args.one_row_gemv, args.row_layer):
        if row_layer == "on" and gemv == "off" and len(args.row_layer) > 1:
            continue  # the same runner as row_layer off
        runner = ModelRunner(
            model,
            num_slots=max(args.rows),
            max_len=args.prompt_len + 2,
            graphs=args.graphs,
            compile=args.compile,
            packed_linear=True,
            fuse_projections=args.fuse_projections == "on"
            or (args.fuse_projections == "auto" and on_cuda),
            one_row_gemv=gemv == "on" or (gemv == "auto" and on_cuda),
            row_layer=row_layer == "on",
            linear_state_dtype=getattr(torch, args.linear_state_dtype),
        )
        prefill_ms[f"{gemv}/{row_layer}"] = fill(runner, args, vocab)
        results += [
            dict(profile_steps(runner, args, rows), gemv=gemv, row_layer=row_layer)
            for rows in args.rows
        ]
        device = runner.device
        del runner  # its cache and graphs, before the next one's
        if on_cuda:
            torch.cuda.empty_cache()
    num_bytes = weight_bytes(model)
    bandwidth = copy_bandwidth_gb_s(device, min(num_bytes, 1 << 30))
    tflops = matmul_tflops(device, getattr(torch, args.dtype))
    state_itemsize = getattr(torch, args.linear_state_dtype).itemsize
    floor = ByteFloor(model, bandwidth, tflops, state_itemsize)
    for result in results:
        result["floor_ms"] = floor.step_ms(result["rows"], args.prompt_len)
        result["pct_floor"] = 100 * result["floor_ms"] / result["step_ms"]
    report = {
        "meta": {
            "machine": platform.platform(),
            "device": torch.cuda.get_device_name() if on_cuda else "cpu",
            "threads": torch.get_num_threads(),
            **{k: v for k, v in vars(args).items() if k != "out"},
            "copy_bandwidth_gb_s": bandwidth,
            "matmul_tflops": tflops,
            "weight_bytes": num_bytes,
            "decode_read_bytes": floor.weight_bytes,
            "kv_bytes_per_token": floor.kv_bytes_per_token,
            "linear_state_bytes_per_seq": floor.state_bytes_per_seq,
        },
        "prefill_ms_per_prompt": prefill_ms,
        "results": results,
    }
    print(
        f"\n{args.model} on {report['meta']['device']}, prompt {args.prompt_len}, graphs "
        f"{args.graphs}, compile {args.compile}, linear state {args.linear_state_dtype}; "
        f"prefill ms per prompt {', '.join(f'{v:.1f} (gemv/fused layer {k})' for k, v in prefill_ms.items())}"
    )
    for result in results:
        print_result(result, result["floor_ms"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
