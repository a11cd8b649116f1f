"""Where one engine decode step spends its time: torch profiler over a few steps of the runner.

python benchmarks/profile_decode.py --model qwen3-1.7b --device cuda --rows 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_throughput import MODELS, random_model  # noqa: E402

from areno.engine.runner import ModelRunner  # noqa: E402
from areno.processing.types import PromptInputs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=MODELS, default="qwen3-1.7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--graphs", default="auto", choices=["auto", "off", "capture"])
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = random_model(args.model, args.device, dtype)
    vocab = model.config.get_text_config().vocab_size
    runner = ModelRunner(
        model, num_slots=args.rows, max_len=args.prompt_len + 2 * args.steps + 8, graphs=args.graphs
    )
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    start = time.perf_counter()
    for slot in range(args.rows):
        ids = torch.randint(0, vocab, (args.prompt_len,)).tolist()
        runner.prefill(PromptInputs(ids, {}), [slot])
    sync()
    print(f"prefill: {(time.perf_counter() - start) / args.rows * 1000:.1f} ms per prompt")
    slots = list(range(args.rows))

    def steps(n: int, offset: int) -> float:
        sync()
        t = time.perf_counter()
        for k in range(n):
            runner.decode(slots, [args.prompt_len + offset + k] * args.rows, [7] * args.rows)
        sync()
        return (time.perf_counter() - t) / n

    steps(3, 0)
    print(f"decode: {steps(args.steps, 3) * 1000:.2f} ms per step of {args.rows} rows")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        steps(5, 3 + args.steps)
    sort = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
