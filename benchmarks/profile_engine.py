"""Where the engine's wall time goes: the engine benchmark's GPU workload with each part of a step
timed (scheduling, decode forward, prefill, sampling, output bookkeeping), then a torch profile
of a few steady decode steps (GPU kernel time per step, top kernels).

The parts are timed by wrapping the engine's own methods in this process; on CUDA each wrapped
device part ends with a synchronize so its time includes the GPU work it launched (the engine
waits for it anyway when it copies the sampled tokens to the host).

    python benchmarks/profile_engine.py --model qwen3-1.7b --decode-compile off inductor
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_throughput import run_requests  # noqa: E402
from engine_workloads import MODELS, make_random_id_workload, random_model  # noqa: E402

from areno.engine.config import COMPILE_MODES, EngineConfig  # noqa: E402
from areno.engine.generator import Generator  # noqa: E402
from areno.engine.parallel import worker as worker_module


class PartTimer:
    """Accumulates wall time per named part of the engine step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def wrap(self, owner: object, method: str, part: str, sync: bool) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            if sync and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[part] += time.perf_counter() - start
            self.calls[part] += 1
            return result

        setattr(owner, method, timed)


class GraphReplayTimer:
    """Within the block, CUDA events around every CUDA graph replay: their summed GPU time, and
    the host time the replay calls themselves took (the graph launch)."""

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.ms = 0.0
        self.launch_s = 0.0

    def __enter__(self) -> GraphReplayTimer:
        if self.enabled:
            self._replay = replay = torch.cuda.CUDAGraph.replay
            events = self.events

            def timed(graph):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                launched = time.perf_counter()
                replay(graph)
                self.launch_s += time.perf_counter() - launched
                end.record()
                events.append((start, end))

            torch.cuda.CUDAGraph.replay = timed
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            torch.cuda.CUDAGraph.replay = self._replay
            torch.cuda.synchronize()
            self.ms = sum(start.elapsed_time(end) for start, end in self.events)


def profile_one(
    model,
    requests,
    concurrency: int,
    compile_mode: str,
    device,
    overlap: str = "off",
    prefill_compile: str = "auto",
    fuse_projections: str = "auto",
    host_functions: int = 0,
) -> dict:
    max_len = max(r["prompt_inputs"].num_prompt_tokens + r["max_tokens"] for r in requests)
    config = EngineConfig(
        max_running_prompts=concurrency,
        max_context_len=max_len + 1,
        decode_compile=compile_mode,
        overlap_steps=overlap,
        prefill_compile=prefill_compile,
        fuse_projections=fuse_projections,
    )
    start = time.perf_counter()
    generator = Generator.from_model(model, None, config)
    # the parts are the in-process worker's own methods, wrapped here (a profiler reaches in)
    core, worker = generator.core, generator.core.executor.worker
    timer = PartTimer(device)
    timer.wrap(core, "step", "step (all)", sync=False)
    timer.wrap(core.scheduler, "schedule", "schedule", sync=False)
    timer.wrap(core, "_step_input", "step input", sync=False)
    timer.wrap(worker.runner, "decode", "decode forward", sync=True)
    timer.wrap(worker_module, "run_prefills", "prefill forward", sync=True)
    timer.wrap(worker, "_sample", "sample + copy", sync=True)
    timer.wrap(core, "_update", "update outputs", sync=False)

    try:
        run_requests(generator, [dict(r, max_tokens=2) for r in requests[:concurrency]])
        asyncio.run(generator.reset_prefix_cache())  # the timed prompts prefill whole
        warmup_s = time.perf_counter() - start
        timer.seconds.clear()
        timer.calls.clear()
        start = time.perf_counter()
        with GraphReplayTimer(device) as replays:
            outputs = run_requests(generator, requests)
        wall_s = time.perf_counter() - start
        # The profiles below step the engine too: the parts are read from the timed run alone.
        seconds, calls = dict(timer.seconds), dict(timer.calls)
        if replays.ms:
            # GPU time of the decode graphs alone; "decode forward" less this is host time, of
            # which "graph launch (host)" is the replay calls'.
            seconds["decode graph (GPU)"] = replays.ms / 1000
            seconds["graph launch (host)"] = replays.launch_s
        kernels = kernel_profile(generator, requests[:concurrency], device)
        host = host_profile(generator, requests) if host_functions else {}
    finally:
        generator.shutdown()
    tokens = sum(len(out.samples[0].token_ids) for out in outputs)
    steps = calls["step (all)"]
    return {
        "decode_compile": compile_mode,
        "overlap_steps": overlap,
        "prefill_compile": prefill_compile,
        "fuse_projections": fuse_projections,
        "warmup_s": warmup_s,
        "wall_s": wall_s,
        "tok_s": tokens / wall_s,
        "steps": steps,
        "ms_per_step": {k: 1000 * v / steps for k, v in seconds.items()},
        "outside_steps_ms_per_step": 1000 * (wall_s - seconds["step (all)"]) / steps,
        **kernels,
        **host,
    }


def host_profile(generator, requests, top: int = 40) -> dict:
    """The engine thread's Python functions over a run of `requests` (cProfile, per step): where
    the host's share of a step goes. The profiler slows the host, so only the split between
    functions is read from it, never the step time."""
    core = generator.core
    profiler = cProfile.Profile()
    inner = core.step
    calls = {"steps": 0}

    def profiled():
        calls["steps"] += 1
        return profiler.runcall(inner)

    core.step = profiled
    try:
        run_requests(generator, requests)
    finally:
        core.step = inner
    stats = pstats.Stats(profiler)
    steps = max(calls["steps"], 1)
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return {
        "host_profile_steps": steps,
        "host_self_ms_per_step": [
            (f"{Path(file).name}:{line} {name}", 1000 * own / steps, 1000 * cumulative / steps)
            for (file, line, name), (_, _, own, cumulative, _) in rows
        ],
    }


def kernel_profile(generator, requests, device) -> dict:
    """GPU kernel time of steady decode steps (a batch of requests decoding 40 tokens), and of
    one batch's prefill alone (the same prompts with one output token: its prefill forwards and
    a first sampling only), each per step."""
    if device.type != "cuda":
        return {}
    asyncio.run(generator.reset_prefix_cache())
    decode = _profiled(generator, [dict(r, max_tokens=40) for r in requests], 40)
    calls = {"prefill": 0}
    inner = worker_module.run_prefills

    def counted(*args, **kwargs):
        calls["prefill"] += 1
        return inner(*args, **kwargs)

    worker_module.run_prefills = counted
    asyncio.run(generator.reset_prefix_cache())  # else the decode profile's prompts are cached
    try:
        prefill = _profiled(generator, [dict(r, max_tokens=1) for r in requests], None, calls)
    finally:
        worker_module.run_prefills = inner
    return {
        "profiled_steps": 40,
        **decode,
        "prefill_steps": calls["prefill"],
        **{f"prefill_{key}": value for key, value in prefill.items()},
    }


def _profiled(generator, requests, steps: int | None, calls: dict | None = None) -> dict:
    """Kernel time per step of running `requests`: `steps` steps, or the steps `calls` counts."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run_requests(generator, requests)
    steps = steps or max(calls["prefill"], 1)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in events)
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:30]
    return {
        "gpu_kernel_ms_per_step": total_us / 1000 / steps,
        "kernel_launches_per_step": sum(e.count for e in events) / steps,
        "top_kernels_ms_per_step": [
            (e.key[:70], e.self_device_time_total / 1000 / steps, e.count // steps) for e in top
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=MODELS[1:], default="qwen3-1.7b")
    parser.add_argument("--decode-compile", nargs="+", choices=COMPILE_MODES, default=["off"])
    parser.add_argument(
        "--overlap-steps",
        choices=["off", "on"],
        default="off",
        help="EngineConfig.overlap_steps; on: the parts overlap (read only the step and GPU rows)",
    )
    parser.add_argument(
        "--prefill-compile", choices=COMPILE_MODES, default="auto", help="EngineConfig's"
    )
    parser.add_argument(
        "--fuse-projections", choices=["auto", "on", "off"], default="auto", help="EngineConfig's"
    )
    parser.add_argument(
        "--host-functions",
        type=int,
        default=0,
        help="also profile the engine's Python functions (cProfile) and print this many",
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/profile_engine.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(args.model, str(device), dtype)
    vocab = model.config.get_text_config().vocab_size
    requests = make_random_id_workload(0, args.num_requests, 256, 128, vocab)
    results = []
    for mode in args.decode_compile:
        result = profile_one(
            model,
            requests,
            args.concurrency,
            mode,
            device,
            args.overlap_steps,
            args.prefill_compile,
            args.fuse_projections,
            args.host_functions,
        )
        results.append(result)
        print(
            f"\n{args.model} decode_compile={mode}: {result['tok_s']:.0f} tok/s, "
            f"{result['steps']} steps, warm-up {result['warmup_s']:.1f} s"
        )
        for part, ms in result["ms_per_step"].items():
            print(f"  {part:<18} {ms:8.2f} ms/step")
        print(f"  {'outside steps':<18} {result['outside_steps_ms_per_step']:8.2f} ms/step")
        if "gpu_kernel_ms_per_step" in result:
            print(
                f"  GPU kernels {result['gpu_kernel_ms_per_step']:.2f} ms/step, "
                f"{result['kernel_launches_per_step']:.0f} launches/step"
            )
            for name, ms, count in result["top_kernels_ms_per_step"]:
                print(f"    {ms:7.3f} ms x{count:<4} {name}")
            print(
                f"  a prefill step alone ({result['prefill_steps']} of them): GPU kernels "
                f"{result['prefill_gpu_kernel_ms_per_step']:.2f} ms/step, "
                f"{result['prefill_kernel_launches_per_step']:.0f} launches/step"
            )
            for name, ms, count in result["prefill_top_kernels_ms_per_step"]:
                print(f"    {ms:7.3f} ms x{count:<4} {name}")
        for name, own, cumulative in result.get("host_self_ms_per_step", [])[: args.host_functions]:
            print(f"    host {own:7.3f} ms own {cumulative:7.3f} ms with callees  {name}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
