"""The CPU prefill's gated delta rule against transformers' own, at the small Qwen3.5 checkpoint's
linear-attention heads (4 key heads and 8 value heads of 64; fp32).

Baseline: transformers' `torch_chunk_gated_delta_rule` (what its Qwen3.5 layers run without
flash-linear-attention, chunks of 64), given the key heads already repeated to the value heads
as its layer does. Engine: `chunked_gated_delta_torch` (kernels/chunked_delta.py), which the
engine's CPU prefill runs. Both from a zero state, returning the final state. Prints a table of
milliseconds per call (median of --repeats) and writes JSON.

    python benchmarks/cpu_delta_rule.py [--out benchmarks/results/cpu_delta_rule.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

sys.path.insert(0, str(Path(__file__).parent))
from engine_workloads import write_results  # noqa: E402

from areno.engine.kernels.chunked_delta import chunked_gated_delta_torch  # noqa: E402

KEY_HEADS, VALUE_HEADS, DIM = 4, 8, 64
PROMPTS = ((1, 32), (1, 160), (4, 165), (16, 256), (32, 256))  # (prompts, tokens)


def inputs(batch: int, tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    query, key = (
        F.normalize(torch.randn(batch, tokens, KEY_HEADS, DIM, generator=gen), dim=-1)
        for _ in range(2)
    )
    value = torch.randn(batch, tokens, VALUE_HEADS, DIM, generator=gen)
    beta = torch.rand(batch, tokens, VALUE_HEADS, generator=gen)
    log_decay = -torch.rand(batch, tokens, VALUE_HEADS, generator=gen)
    return query, key, value, beta, log_decay


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def row(batch: int, tokens: int, seed: int, repeats: int) -> dict:
    query, key, value, beta, log_decay = inputs(batch, tokens, seed)
    group = VALUE_HEADS // KEY_HEADS
    q_rep, k_rep = (x.repeat_interleave(group, dim=2) for x in (query, key))
    hf_ms = median_ms(
        lambda: torch_chunk_gated_delta_rule(
            q_rep, k_rep, value, log_decay, beta, output_final_state=True
        ),
        repeats,
    )
    engine_ms = median_ms(
        lambda: chunked_gated_delta_torch(query, key, value, beta, log_decay), repeats
    )
    return {
        "prompts": batch,
        "tokens": tokens,
        "transformers_ms": hf_ms,
        "engine_ms": engine_ms,
        "speedup": hf_ms / engine_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/cpu_delta_rule.json")
    args = parser.parse_args()
    with torch.inference_mode():
        rows = [row(batch, tokens, args.seed, args.repeats) for batch, tokens in PROMPTS]
    print(f"threads {torch.get_num_threads()}; ms per call, median of {args.repeats}")
    print(f"{'prompts x tokens':>16} {'transformers':>12} {'engine':>8} {'x':>6}")
    for r in rows:
        shape = f"{r['prompts']} x {r['tokens']}"
        print(
            f"{shape:>16} {r['transformers_ms']:>12.2f} {r['engine_ms']:>8.2f} {r['speedup']:>6.2f}"
        )
    meta = {"seed": args.seed, "threads": torch.get_num_threads(), "repeats": args.repeats}
    write_results(args.out, meta, {"rows": rows})


if __name__ == "__main__":
    main()
