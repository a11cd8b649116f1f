"""Where a batched text prefill's time goes: the host's time to launch it against the device's
time to run it, and its top host operators and device kernels.

A `ModelRunner` (no decode graphs, the prefill compiled as the engine compiles it) prefills
`--prompts` random prompts of `--length` tokens again and again; each repeat records
- host ms: until `prefill_batch` returns (kernels launched, not finished),
- device ms: CUDA events around it,
- wall ms: until the device is done.
Host ms near wall ms means the launch, not the device, sets the pace. `--mask` compares the
engine's mask function (a plain causal prefill left to SDPA's `is_causal`, attention.py) with
transformers' own `sdpa_mask`, which under torch.compile on torch before 2.14 materializes the
mask (SDPA then takes its memory-efficient kernel). JSON goes to --out.

    python benchmarks/profile_prefill.py --model qwen3-1.7b --mask engine transformers
    python benchmarks/profile_prefill.py --model small --prefill-compile aot_eager   # CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

sys.path.insert(0, str(Path(__file__).parent))
from engine_workloads import (  # noqa: E402
    MODELS,
    load_small,
    random_model,
    synchronize,
    write_results,
)

from areno.engine.layers.attention import ENGINE_SDPA, engine_sdpa_mask  # noqa: E402
from areno.engine.runner.model_runner import ModelRunner  # noqa: E402
from areno.processing.types import PromptInputs  # noqa: E402

MASKS = {"engine": engine_sdpa_mask, "transformers": sdpa_mask}


def prompts(num: int, length: int, vocab: int, seed: int) -> list[PromptInputs]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (num, length), generator=gen)
    return [PromptInputs(input_ids=row, mm_inputs={}) for row in ids.tolist()]


def profile_mask(runner: ModelRunner, batch: list[PromptInputs], mask: str, repeats: int) -> dict:
    ALL_MASK_ATTENTION_FUNCTIONS.register(ENGINE_SDPA, MASKS[mask])
    slots = [[i] for i in range(len(batch))]
    start = time.perf_counter()
    # As the engine's start-up does: two short prompts compile the prefill (again for a second
    # mask: the mask function is a global the compiled graph guards on).
    runner.prefill_batch([PromptInputs([0] * n, {}) for n in (2, 3)], [[0], [1]])
    synchronize(runner.device)
    compile_s = time.perf_counter() - start
    runner.prefill_batch(batch, slots)
    on_cuda = runner.device.type == "cuda"
    host, device, wall = [], [], []
    for _ in range(repeats):
        synchronize(runner.device)
        if on_cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start = time.perf_counter()
        runner.prefill_batch(batch, slots)
        host.append(1000 * (time.perf_counter() - start))
        if on_cuda:
            end.record()
        synchronize(runner.device)
        wall.append(1000 * (time.perf_counter() - start))
        if on_cuda:
            device.append(begin.elapsed_time(end))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        runner.prefill_batch(batch, slots)
        synchronize(runner.device)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host_ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    return {
        "mask": mask,
        "compile_s": compile_s,
        "host_ms": statistics.median(host),
        "device_ms": statistics.median(device) if device else None,
        "wall_ms": statistics.median(wall),
        "top_kernels_ms": [
            (e.key[:70], e.self_device_time_total / 1000, e.count)
            for e in sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:15]
        ],
        "top_host_ops_ms": [
            (e.key[:70], e.self_cpu_time_total / 1000, e.count)
            for e in sorted(host_ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=MODELS, default="qwen3-1.7b", help="small: on CPU, fp32")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--mask", nargs="+", choices=list(MASKS), default=["engine"])
    parser.add_argument("--prefill-compile", default="inductor")
    parser.add_argument("--fuse-projections", choices=["on", "off"], default="on")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/profile_prefill.json")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() and args.model != "small" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.model == "small":
        model, _ = load_small("qwen3_5", device, dtype)
    else:
        model = random_model(args.model, device, dtype)
    runner = ModelRunner(
        model,
        num_slots=max(args.prompts, 2),  # the compile runs two prompts
        max_len=args.length + 1,
        graphs="off",
        compile="off",
        prefill_compile=args.prefill_compile,
        fuse_projections=args.fuse_projections == "on",
        packed_linear=device == "cpu",  # as the engine runs on CPU (EngineConfig's default)
    )
    runner.prefill(PromptInputs([0], {}), [0])  # allocates the cache, uncompiled
    vocab = model.config.get_text_config().vocab_size
    batch = prompts(args.prompts, args.length, vocab, args.seed)
    results = []
    for mask in args.mask:
        result = profile_mask(runner, batch, mask, args.repeats)
        results.append(result)
        device_ms = result["device_ms"]
        print(
            f"\n{args.model}, {args.prompts} x {args.length} tokens, mask {mask}: host "
            f"{result['host_ms']:.1f} ms, device {device_ms if device_ms is None else round(device_ms, 1)} ms, "
            f"wall {result['wall_ms']:.1f} ms (compile {result['compile_s']:.1f} s)"
        )
        for title, key in (("kernels", "top_kernels_ms"), ("host operators", "top_host_ops_ms")):
            print(f"  top {title} (ms, calls):")
            for name, ms, count in result[key]:
                print(f"    {ms:8.3f} x{count:<5} {name}")
    meta = {"model": args.model, "prompts": args.prompts, "length": args.length, "seed": args.seed}
    meta |= {"prefill_compile": args.prefill_compile, "fuse_projections": args.fuse_projections}
    write_results(args.out, meta, {"results": results})


if __name__ == "__main__":
    main()
