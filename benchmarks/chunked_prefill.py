"""What a long prompt does to the streams already decoding: their inter-token latency with the
prompt prefilled whole against prefilled in chunks (`--max-num-batched-tokens`).

Workload (fixed seed): the small `make-tiny --size small` checkpoint of --family (fp32, CPU by
default); 16 streaming requests of 64 random prompt tokens, each generating 160 tokens (EOS
ignored); once every stream has 16 tokens, one request of 4,000 random prompt tokens arrives
(max_tokens 8). For each prefill budget the table gives the streams' inter-token gaps (every
stream's time between two consecutive tokens, every gap that ends after the long prompt arrives):
p50, p99 and the largest, the long prompt's time to its first token, and the whole run's output
tokens per second. The largest budget prefills the long prompt in one step: the baseline.

Read the largest gap for the stall: the p99 counts how many steps carry a chunk as much as how
long they take (prefilled whole, the stall is one gap in each stream's 144, under 1%; in chunks
of 128 tokens a fifth of the steps carry one).

    python benchmarks/chunked_prefill.py [--budgets 8192 256 128 64 32] [--family qwen3_5]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch
from engine_workloads import load_small, write_results

from areno.engine.config import EngineConfig
from areno.engine.generator import Generator
from areno.engine.sampling import SamplingParams
from areno.models.tiny import TINY_FAMILIES
from areno.processing.types import PromptInputs

NUM_STREAMS, STREAM_PROMPT, STREAM_TOKENS, START_AFTER = 16, 64, 160, 16
LONG_PROMPT, LONG_TOKENS = 4000, 8


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run_once(gen: Generator, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    streams = [
        PromptInputs([rng.randrange(10, vocab) for _ in range(STREAM_PROMPT)], {})
        for _ in range(NUM_STREAMS)
    ]
    long = PromptInputs([rng.randrange(10, vocab) for _ in range(LONG_PROMPT)], {})
    stream_params = SamplingParams(temperature=0, max_tokens=STREAM_TOKENS, ignore_eos=True)
    arrivals: list[list[float]] = [[] for _ in streams]
    started = asyncio.Event()
    long_arrived = [0.0]

    async def stream(i: int, prompt: PromptInputs) -> None:
        async for output in gen.generate(prompt, stream_params):
            arrivals[i].extend([time.perf_counter()] * len(output.samples[0].token_ids))
            if all(len(a) >= START_AFTER for a in arrivals):
                started.set()

    async def long_request() -> float:
        await started.wait()
        long_arrived[0] = time.perf_counter()
        params = SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True)
        async for _ in gen.generate(long, params):
            return time.perf_counter() - long_arrived[0]
        return float("nan")

    start = time.perf_counter()
    *_, ttft = await asyncio.gather(*(stream(i, p) for i, p in enumerate(streams)), long_request())
    wall = time.perf_counter() - start
    gaps = [
        (b - a) * 1e3
        for times in arrivals
        for a, b in zip(times, times[1:], strict=False)
        if b > long_arrived[0]  # every gap that ends after it arrived
    ]
    tokens = sum(len(a) for a in arrivals) + LONG_TOKENS
    return {
        "itl_p50_ms": percentile(gaps, 0.5),
        "itl_p99_ms": percentile(gaps, 0.99),
        "itl_max_ms": max(gaps),
        "itl_mean_ms": statistics.fmean(gaps),
        "p99_over_p50": percentile(gaps, 0.99) / percentile(gaps, 0.5),
        "long_ttft_s": ttft,
        "tok_s": tokens / wall,
        "num_gaps": len(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=TINY_FAMILIES, default="qwen3_5")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8192, 256, 128, 64, 32])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/chunked_prefill.json")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model, processor = load_small(args.family, args.device, dtype)
    vocab = model.config.get_text_config().vocab_size
    rows = []
    for budget in args.budgets:
        config = EngineConfig(
            max_running_prompts=NUM_STREAMS + 1,
            max_context_len=4096,  # the small checkpoint's positions
            max_num_batched_tokens=budget,
            kv_cache_gib=0.5,
        )
        gen = Generator.from_model(model, processor.tokenizer, config)
        try:
            result = asyncio.run(run_once(gen, vocab, args.seed))
        finally:
            gen.shutdown()
        chunked = budget < LONG_PROMPT
        rows.append({"budget": budget, "chunked": chunked, **result})
        print(f"budget {budget}: {result}")
    print(
        f"\n{args.family} small, {args.device}: {NUM_STREAMS} streams of {STREAM_TOKENS} tokens, "
        f"a {LONG_PROMPT}-token prompt arriving once each has {START_AFTER}"
    )
    header = f"{'budget':>7} {'prefill':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"
    print(header + f" {'p99/p50':>8} {'long TTFT s':>12} {'tok/s':>8}")
    for row in rows:
        print(
            f"{row['budget']:>7} {'chunks' if row['chunked'] else 'whole':>8} "
            f"{row['itl_p50_ms']:>8.1f} {row['itl_p99_ms']:>8.1f} {row['itl_max_ms']:>8.1f} "
            f"{row['p99_over_p50']:>8.2f} {row['long_ttft_s']:>12.2f} {row['tok_s']:>8.1f}"
        )
    meta = {
        "family": args.family,
        "device": args.device,
        "seed": args.seed,
        "streams": NUM_STREAMS,
        "stream_prompt_tokens": STREAM_PROMPT,
        "stream_tokens": STREAM_TOKENS,
        "long_prompt_tokens": LONG_PROMPT,
    }
    write_results(args.out, meta, {"rows": rows})


if __name__ == "__main__":
    main()
