"""Where an engine's start-up goes: `Generator.from_config` as `areno serve` builds it, in a fresh
process, first on an empty compile cache and then on the warm one (areno/engine/compile_cache.py).

Each start is a child process of this script (`--child`), so imports and caches start cold as in
a server's replica. It reports: the imports (torch, transformers, AReno's engine), the engine's
own phases (load, cache, compile, warm-up), and inside compile: Dynamo's tracing, the backend
(AOTAutograd and Inductor, cached or not), the CUDA graph captures, and Inductor's and
AOTAutograd's cache counters (hits, misses, bypasses). Default: the tiny Qwen3.5 on CPU; on a GPU
machine pass a 2B-shaped checkpoint and `--device cuda`. Prints a table and writes JSON
(default benchmarks/results/engine_startup.json).

    python benchmarks/engine_startup.py [--model-path CKPT] [--device cuda] [--warm-starts 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()

# Dynamo's timed sections (torch._dynamo.utils.compile_times) this table reads, by their names.
TRACE = "_compile.compile_inner"  # a frame's whole compile, the backend's included
BACKEND = "OutputGraph.call_user_compiler"
# A graph traced to be saved (torch's aot_compile, areno/engine/runner/saved_traces.py): its
# whole compile, the backend's included, in place of TRACE.
AOT_COMPILE = "fullgraph_capture"


def child(args: argparse.Namespace) -> dict:
    """One engine start in this process; the seconds of each part."""
    import torch
    import transformers  # noqa: F401
    from torch._dynamo.utils import compile_times, counters

    from areno.engine import compile_cache
    from areno.engine.config import EngineConfig
    from areno.engine.generator import Generator
    from areno.engine.runner.cuda_graphs import DecodeGraphs

    imported = time.perf_counter() - STARTED
    captures: list[float] = []
    capture = DecodeGraphs._capture

    def timed_capture(self, rows, kv_len):
        start = time.perf_counter()
        try:
            return capture(self, rows, kv_len)
        finally:
            captures.append(time.perf_counter() - start)

    DecodeGraphs._capture = timed_capture
    config = EngineConfig(
        device=args.device,
        max_running_prompts=args.max_running_prompts,
        decode_compile=args.compile,
        prefill_compile=args.compile,
        pad_lone_prefills=args.pad_lone_prefills,
        whole_prompts_as_parts=args.whole_prompts_as_parts,
    )
    generator = Generator.from_config(args.model_path, config)
    try:
        headers, values = compile_times(repr="csv", aggregate=True)
        timed = {name: float(value) for name, value in zip(headers, values, strict=True)}
        caches = {
            key: dict(counters[key]) for key in ("inductor", "aot_autograd") if counters.get(key)
        }
        return {
            "imports": imported,
            **generator.start_up,
            "dynamo_frames_s": timed.get(TRACE, 0.0),
            "aot_compile_s": timed.get(AOT_COMPILE, 0.0),
            "compile_times": timed,
            "backend_s": timed.get(BACKEND, 0.0),
            "captures_s": sum(captures),
            "captures": len(captures),
            "compiles_s": generator.start_up_compiles,
            "frames": counters["frames"]["ok"],
            "traces_loaded": compile_cache.traces["loaded"],
            "traces_traced": compile_cache.traces["traced"],
            "cache_counters": {
                key: {name: n for name, n in values.items() if "cache" in name or "bypass" in name}
                for key, values in caches.items()
            },
            "device": str(torch.cuda.get_device_name()) if args.device == "cuda" else "cpu",
        }
    finally:
        generator.shutdown()


def start_once(args: argparse.Namespace, cache: Path) -> dict:
    command = [
        sys.executable, __file__, "--child", "--model-path", args.model_path,
        "--device", args.device, "--compile", args.compile,
        "--pad-lone-prefills", args.pad_lone_prefills,
        "--whole-prompts-as-parts", args.whole_prompts_as_parts,
        "--max-running-prompts", str(args.max_running_prompts),
    ]  # fmt: skip
    env = dict(os.environ, ARENO_COMPILE_CACHE=str(cache))
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the start failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"wall_s": round(wall, 2), **result}


COLUMNS = (
    ("wall", "wall_s"),
    ("imports", "imports"),
    ("load", "load"),
    ("cache", "cache"),
    ("compile", "compile"),
    ("  dynamo", "dynamo_frames_s"),
    ("  aot_compile", "aot_compile_s"),
    ("  backend", "backend_s"),
    ("  captures", "captures_s"),
    ("warm-up", "warm-up"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", help="a checkpoint (default: the tiny Qwen3.5)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--compile", default="inductor", choices=["inductor", "off"])
    parser.add_argument(
        "--pad-lone-prefills",
        default="auto",
        choices=["auto", "on", "off"],
        help="EngineConfig.pad_lone_prefills (auto: on CUDA): on, no prefill graph of one row",
    )
    parser.add_argument(
        "--whole-prompts-as-parts",
        default="auto",
        choices=["auto", "on", "off"],
        help="EngineConfig.whole_prompts_as_parts (auto: on CUDA): on, no batched prefill graph",
    )
    parser.add_argument("--max-running-prompts", type=int, default=8)
    parser.add_argument("--warm-starts", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/engine_startup.json")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    with tempfile.TemporaryDirectory(prefix="areno-engine-startup-") as tmp:
        if args.model_path is None:
            from areno.models.tiny import tiny_checkpoint

            args.model_path = str(tiny_checkpoint("qwen3_5"))
        cache = Path(tmp) / "compile-cache"
        rows = []
        for index in range(1 + args.warm_starts):
            name = "first start (empty cache)" if index == 0 else f"start {index + 1} (warm)"
            rows.append({"start": name, **start_once(args, cache)})
            print(f"{name}: {rows[-1]['wall_s']} s", flush=True)
    print(f"\n{'start':<28}" + "".join(f"{title:>13}" for title, _ in COLUMNS))
    for row in rows:
        cells = "".join(f"{row.get(key, 0.0):>12.1f}s" for _, key in COLUMNS)
        print(f"{row['start']:<28}{cells}")
    for row in rows:
        print(
            f"{row['start']}: {row['frames']} frames compiled, Dynamo traces "
            f"{row.get('traces_loaded', 0)} loaded and {row.get('traces_traced', 0)} traced, "
            f"{row['captures']} captures; "
            f"caches {row['cache_counters']}"
        )
    result = {
        "benchmark": "engine_startup",
        "model_path": args.model_path,
        "device": args.device,
        "compile": args.compile,
        "pad_lone_prefills": args.pad_lone_prefills,
        "whole_prompts_as_parts": args.whole_prompts_as_parts,
        "max_running_prompts": args.max_running_prompts,
        "meta": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
