"""Multi-turn text episodes resuming from the prefix cache together, as a GRPO group's turns do:
their resumptions prefilled one at a time (each its own forward) against shared forwards of
parts (`ModelRunner.prefill_parts`), side by side in one run on the same episodes.

`--episodes` episodes start from random-id prompts of `--prompt-tokens`; each turn generates
`--new-tokens` greedily, then the next turn's prompt is the last one, its output and
`--turn-tokens` more random ids (a tool result), sent token in. Every later turn resumes where
the turn before ended. Per configuration: the seconds of the later turns (all episodes at once),
the prefill forwards they ran, the prompt tokens the cache held, and how many episodes got the
same greedy tokens both ways.

    python benchmarks/resumed_prefill.py                                    # small Qwen3.5, CPU
    python benchmarks/resumed_prefill.py --model qwen3.5-2b --device cuda --dtype bfloat16 \\
        --episodes 64 --prompt-tokens 256 --decode-compile off --prefill-compile off
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_workloads import load_small, random_model, synchronize, write_results  # noqa: E402

from areno.engine.config import COMPILE_MODES, EngineConfig  # noqa: E402
from areno.engine.generator import Generator  # noqa: E402
from areno.engine.sampling import SamplingParams  # noqa: E402
from areno.processing.types import PromptInputs  # noqa: E402

MODES = {"one at a time": False, "shared forwards": True}
PREFILLS = ("prefill", "prefill_batch", "prefill_chunk", "prefill_parts")  # the runner's


def episodes(seed: int, args, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each episode's first prompt and, per later turn, the ids its tool result adds."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[list[int]]:
        return torch.randint(100, vocab, (args.episodes, n), generator=gen).tolist()

    return ids(args.prompt_tokens), [ids(args.turn_tokens) for _ in range(args.turns - 1)]


def run_episodes(generator: Generator, first: list[list[int]], later: list[list[list[int]]], args):
    """Every episode's turns, the episodes of a turn together; (tokens per turn, seconds of the
    later turns, prefill forwards of the later turns)."""
    params = SamplingParams(
        temperature=0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False
    )
    runner = generator.core.executor.runner
    forwards = {"n": 0, "depth": 0}  # a chunk that starts its prompt calls `prefill`: one
    for name in PREFILLS:
        inner = getattr(runner, name)

        def counted(*a, inner=inner, **k):
            forwards["n"] += forwards["depth"] == 0
            forwards["depth"] += 1
            try:
                return inner(*a, **k)
            finally:
                forwards["depth"] -= 1

        setattr(runner, name, counted)

    async def turn(prompts: list[list[int]]) -> list[list[int]]:
        outputs = await asyncio.gather(
            *(generator.generate_all(PromptInputs(p, {}), params) for p in prompts)
        )
        return [o.samples[0].token_ids for o in outputs]

    prompts, tokens, start = first, [], 0.0
    device = runner.device
    for i in range(args.turns):
        if i == 1:
            synchronize(device)
            start, forwards["n"] = time.perf_counter(), 0
        out = asyncio.run(turn(prompts))
        tokens.append(out)
        if i + 1 < args.turns:
            prompts = [p + o + t for p, o, t in zip(prompts, out, later[i], strict=True)]
    synchronize(device)
    later_s = time.perf_counter() - start
    for name in PREFILLS:
        delattr(runner, name)
    return tokens, later_s, forwards["n"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="small, or a random shape (qwen3.5-2b)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--turn-tokens", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--decode-compile", default="auto", choices=COMPILE_MODES)
    parser.add_argument("--prefill-compile", default="auto", choices=COMPILE_MODES)
    parser.add_argument("--out", default="benchmarks/results/resumed_prefill.json")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    if args.model == "small":
        model, processor = load_small("qwen3_5", args.device, dtype)
        tokenizer = processor.tokenizer
    else:
        model, tokenizer = random_model(args.model, args.device, dtype), None
    vocab = model.config.get_text_config().vocab_size
    context = args.prompt_tokens + args.turns * (args.new_tokens + args.turn_tokens) + 1
    config = EngineConfig(
        max_running_prompts=args.episodes,
        max_context_len=context,
        enable_prefix_caching=True,
        prefix_state_rows=2 * args.episodes,
        decode_compile=args.decode_compile,
        prefill_compile=args.prefill_compile,
    )
    warm_first, warm_later = episodes(args.seed + 1, args, vocab)
    first, later = episodes(args.seed, args, vocab)
    rows, tokens = {}, {}
    for mode, shared in MODES.items():
        generator = Generator.from_model(model, tokenizer, config)
        try:
            generator.core.executor.share_part_prefills(shared)
            run_episodes(generator, warm_first, warm_later, args)  # compiles, captures
            asyncio.run(generator.reset_prefix_cache())
            before = generator.stats()["num_prompt_tokens_cached"]
            tokens[mode], seconds, forwards = run_episodes(generator, first, later, args)
            cached = generator.stats()["num_prompt_tokens_cached"] - before
        finally:
            generator.shutdown()
        rows[mode] = {"later_turns_s": seconds, "prefill_forwards": forwards, "cached": cached}
    same = tokens["one at a time"] == tokens["shared forwards"]
    # Per episode, its tokens in every turn. With random bf16 weights the logits are near-ties
    # that the forwards' shapes can tip (the parity tests hold the tokens equal in fp32).
    alone, shared = tokens["one at a time"], tokens["shared forwards"]
    episodes_same = sum(
        all(alone[t][e] == shared[t][e] for t in range(args.turns)) for e in range(args.episodes)
    )
    base = rows["one at a time"]["later_turns_s"]
    print(
        f"\n{args.model} on {args.device} ({args.dtype}): {args.episodes} episodes x "
        f"{args.turns} turns, prompt {args.prompt_tokens}, +{args.new_tokens} generated "
        f"+{args.turn_tokens} tool tokens a turn\n"
    )
    print("| resumptions | later turns (s) | speed-up | prefill forwards | prompt tokens cached |")
    print("| --- | --- | --- | --- | --- |")
    for mode, row in rows.items():
        print(
            f"| {mode} | {row['later_turns_s']:.2f} | {base / row['later_turns_s']:.2f}x | "
            f"{row['prefill_forwards']} | {row['cached']:,} |"
        )
    print(f"\nepisodes with the same greedy tokens in every turn: {episodes_same}/{args.episodes}")
    meta = {"args": vars(args), "same_tokens": same, "episodes_same": episodes_same}
    write_results(args.out, meta, {"rows": rows})


if __name__ == "__main__":
    main()
