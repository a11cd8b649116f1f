"""What the prefix cache saves an agentic multimodal rollout: a GRPO group of G episodes of one
sample with an image, each running T turns whose prompt is the whole episode so far (the
sample, then each turn's reply and a tool-result message), all episodes at once, through the
Generator with `enable_prefix_caching` off and on, side by side in one run.

Counted from the engine's own stats: prompt tokens admitted, of them those the cache held, and
so those prefilled; and the wall time of the whole group.

    python benchmarks/rollout_prefill.py --family qwen3_vl --group-size 8 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_workloads import load_small, write_results  # noqa: E402

from areno.engine.config import EngineConfig  # noqa: E402
from areno.engine.generator import Generator  # noqa: E402
from areno.engine.sampling import SamplingParams  # noqa: E402
from areno.media import MediaDecoder, MediaPolicy  # noqa: E402
from areno.media.samples import write_image  # noqa: E402
from areno.processing import process_messages  # noqa: E402


def sample_messages(image: Path) -> list[dict]:
    question = (
        "You are looking at a picture from a camera. Describe what you see, then call the "
        "tool that zooms in if anything is unclear, and finally say which object is largest."
    )
    return [
        {"role": "system", "content": "You are a careful visual assistant. " * 8},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": str(image)}},
                {"type": "text", "text": question},
            ],
        },
    ]


async def episode(gen, processor, decoder, messages, turns, max_tokens, seed) -> None:
    messages = list(messages)
    for turn in range(turns):
        inputs = await asyncio.to_thread(process_messages, processor, decoder, messages)
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed * 97 + turn)
        output = await gen.generate_all(inputs, params)
        reply = processor.tokenizer.decode(output.samples[0].token_ids, skip_special_tokens=True)
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"Tool result {turn}: the zoomed region shows more."},
        ]


def run_group(model, processor, messages, args, caching: bool) -> dict:
    config = EngineConfig(
        max_running_prompts=args.group_size,
        max_context_len=args.max_context_len,
        enable_prefix_caching=caching,
    )
    gen = Generator.from_model(model, processor.tokenizer, config)
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())

    async def group() -> None:
        await asyncio.gather(
            *(
                episode(gen, processor, decoder, messages, args.turns, args.max_tokens, seed)
                for seed in range(args.group_size)
            )
        )

    try:
        asyncio.run(group())  # warm-up: the first forwards of each shape, then a fresh cache
        gen.core.scheduler.blocks.forget_cached()
        before = gen.stats()
        start = time.perf_counter()
        asyncio.run(group())
        wall_s = time.perf_counter() - start
        after = gen.stats()
    finally:
        gen.shutdown()
    admitted = after["num_prompt_tokens_admitted"] - before["num_prompt_tokens_admitted"]
    cached = after["num_prompt_tokens_cached"] - before["num_prompt_tokens_cached"]
    return {
        "prefix_caching": caching,
        "prompt_tokens": admitted,
        "cached_tokens": cached,
        "prefilled_tokens": admitted - cached,
        "wall_s": wall_s,
        "turns_per_s": args.group_size * args.turns / wall_s,
        "effective": gen.core.scheduler.config.enable_prefix_caching,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="qwen3_vl")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-context-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/rollout_prefill.json")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model, processor = load_small(args.family, "cpu", torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        messages = sample_messages(write_image(Path(tmp) / "scene.png", 320, 240, seed=args.seed))
        rows = [run_group(model, processor, messages, args, caching) for caching in (False, True)]
    print(
        f"\n{args.family} (small), a group of {args.group_size} episodes x {args.turns} turns, "
        f"one image, {args.max_tokens} tokens a turn"
    )
    header = f"{'prefix cache':<13}{'prompt tok':>11}{'cached':>9}{'prefilled':>10}"
    print(header + f"{'wall s':>9}{'turns/s':>9}")
    print("-" * (len(header) + 18))
    for row in rows:
        on = "on" if row["prefix_caching"] else "off"
        print(
            f"{on:<13}{row['prompt_tokens']:>11}{row['cached_tokens']:>9}"
            f"{row['prefilled_tokens']:>10}{row['wall_s']:>9.2f}{row['turns_per_s']:>9.2f}"
        )
    meta = {key: value for key, value in vars(args).items() if key != "out"}
    write_results(args.out, {**meta, "workload": "rollout_prefill"}, {"rows": rows})


if __name__ == "__main__":
    main()
