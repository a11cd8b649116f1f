"""What the prefix cache saves a GRPO step of the AVE agent
(examples/multimodal/ave_event_recognition): `--prompts` clips, each a group of `--group-size`
episodes of `--turns` turns, all running at once as a rollout worker runs them, through the
serving parts (MediaDecoder, Processor, Generator), with `enable_prefix_caching` off, on with
each resumption prefilled in a forward of its own, and on as the engine runs it (resumptions
and chunks sharing forwards of parts), side by side in one run.

Each turn the policy samples `--max-tokens` tokens; a random policy writes no tool call, so the
benchmark then appends the agent's calls itself (view_frames, listen; the last turn answers),
rendered in the checkpoint's own call syntax, runs the agent's real tools, and sends the next
turn token in, as rollouts do (the last turn's tokens plus the tool result's, media included).

Counted from the engine's own stats: prompt tokens requested (admitted), those the cache held
and so those prefilled; and the wall time of the step (tools, decoding and encoding included).

    python benchmarks/rollout_prefill.py                     # tiny Gemma 4 on CPU
    python benchmarks/rollout_prefill.py --family qwen3_5 --size 2b --device cuda \\
        --dtype bfloat16 --calls view_frames,view_frames --seconds 8 --fps 2 --frame-size 224 \\
        --max-frames 4 --prompts 4 --max-tokens 32
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
sys.path.insert(0, str(Path(__file__).parents[1]))
from engine_workloads import write_results  # noqa: E402

from areno.data import Sample  # noqa: E402
from areno.engine.config import EngineConfig  # noqa: E402
from areno.engine.generator import Generator  # noqa: E402
from areno.engine.sampling import SamplingParams  # noqa: E402
from areno.media import MediaDecoder, MediaPolicy  # noqa: E402
from areno.models.tiny import tiny_checkpoint  # noqa: E402
from areno.processing import Processor  # noqa: E402
from areno.rollout.agent import ToolContext  # noqa: E402
from examples.multimodal.ave_event_recognition.agent import ave_agent  # noqa: E402
from examples.multimodal.ave_event_recognition.generate_dataset import make_split  # noqa: E402


class Rollout:
    """The serving parts of one rollout worker and the agent."""

    def __init__(self, path: str, args, caching: bool):
        self.processor = Processor(path)
        self.decoder = MediaDecoder(MediaPolicy.for_training(), self.processor.decode_options())
        config = EngineConfig(
            max_running_prompts=args.prompts * args.group_size,
            max_context_len=args.max_context_len,
            enable_prefix_caching=caching,
            device=args.device,
            dtype=args.dtype,
            decode_compile=args.decode_compile,
        )
        self.generator = Generator.from_config(path, config)
        self.agent = ave_agent(max_turns=args.turns, max_frames=args.max_frames)
        self.tools = self.agent.tool_schemas
        tokenizer = self.processor.tokenizer
        self.eot = tokenizer.convert_tokens_to_ids(self.processor.adapter.stop_tokens[0])

    def encode(self, messages: list[dict], first: bool):
        media = self.decoder.decode_many(self.processor.media_refs(messages))
        if first:
            return self.processor.encode(messages, media, tools=self.tools)
        return self.processor.encode_continuation(messages, media, tools=self.tools)

    def call_ids(self, name: str, arguments: dict) -> list[int]:
        """A reply that is this one call, in the checkpoint's syntax, closed as a turn."""
        text = self.processor.reply_text("", [(name, arguments)], tools=self.tools)
        return self.processor.tokenizer.encode(text, add_special_tokens=False) + [self.eot]

    async def episode(self, sample: Sample, index: int, calls: list[str], args) -> None:
        messages = self.agent.prompt_messages(sample.messages)
        inputs = await asyncio.to_thread(self.encode, messages, True)
        ctx = ToolContext(sample.id, sample.messages, index)
        span = args.seconds / max(len(calls), 1)
        for turn in range(args.turns):
            params = SamplingParams(
                temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=index * 31 + turn
            )
            output = await self.generator.generate_all(inputs, params)
            if turn == args.turns - 1:
                break
            name = calls[turn % len(calls)]
            arguments = {"start_s": turn * span, "end_s": (turn + 1) * span}
            result = self.agent.call_tool(name, arguments, ctx)
            content = [{"type": "text", "text": result}] if isinstance(result, str) else result
            tool = [{"role": "tool", "tool_call_id": f"call_{turn}", "content": content}]
            delta = await asyncio.to_thread(self.encode, tool, False)
            generated = list(output.samples[0].token_ids) + self.call_ids(name, arguments)
            inputs = self.processor.extend(inputs, generated, delta)

    async def step(self, samples: list[Sample], calls: list[str], args) -> None:
        await asyncio.gather(
            *(
                self.episode(sample, i * args.group_size + g, calls, args)
                for i, sample in enumerate(samples)
                for g in range(args.group_size)
            )
        )


def measure(path: str, samples: list[Sample], args, caching: bool, shared: bool) -> dict:
    """One configuration's timed step; `shared`: resumptions and chunks share the forwards of
    parts (the engine's default), else each runs its own."""
    rollout = Rollout(path, args, caching)
    calls = args.calls.split(",")
    gen = rollout.generator
    gen.core.executor.share_part_prefills(shared)
    try:
        asyncio.run(rollout.step(samples, calls, args))  # warm-up: first forwards of each shape
        gen.core.scheduler.forget_cached()
        before = gen.stats()
        start = time.perf_counter()
        asyncio.run(rollout.step(samples, calls, args))
        wall_s = time.perf_counter() - start
        after = gen.stats()
    finally:
        gen.shutdown()
    requested = after["num_prompt_tokens_admitted"] - before["num_prompt_tokens_admitted"]
    cached = after["num_prompt_tokens_cached"] - before["num_prompt_tokens_cached"]
    return {
        "prefix_caching": caching,
        "shared_resumptions": caching and gen.core.executor.shares_part_prefills,
        "prompt_tokens_requested": requested,
        "prompt_tokens_cached": cached,
        "prompt_tokens_computed": requested - cached,
        "rollout_s": wall_s,
        "episodes": len(samples) * args.group_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="gemma4", help="a tiny checkpoint family")
    parser.add_argument("--size", default="tiny", help="its size (tiny, small, 2b)")
    parser.add_argument("--model-path", help="a checkpoint instead of a tiny one")
    parser.add_argument("--prompts", type=int, default=2, help="clips per GRPO step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--calls", default="view_frames,listen", help="the calls, in turn order")
    parser.add_argument("--max-tokens", type=int, default=16, help="sampled tokens per turn")
    parser.add_argument("--max-frames", type=int, default=2, help="frames a view_frames returns")
    parser.add_argument("--seconds", type=float, default=5.0, help="clip length")
    parser.add_argument("--fps", type=float, default=4.0)
    parser.add_argument("--frame-size", type=int, default=64, help="clip width and height")
    parser.add_argument("--max-context-len", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--decode-compile", default="auto", choices=["auto", "off", "inductor"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/rollout_prefill.json")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    path = args.model_path or str(tiny_checkpoint(args.family, size=args.size))
    with tempfile.TemporaryDirectory() as tmp:
        data = make_split(
            Path(tmp),
            "train",
            args.prompts,
            seed=args.seed,
            seconds=args.seconds,
            fps=args.fps,
            size=args.frame_size,
            data_urls=False,
            progress=False,
        )
        samples = [Sample.from_json(line) for line in data.read_text().splitlines()]
        rows = [
            measure(path, samples, args, caching, shared)
            for caching, shared in ((False, True), (True, False), (True, True))
        ]
    off, alone, on = rows
    print(
        f"\n{Path(path).name}: {args.prompts} clips x {args.group_size} episodes x "
        f"{args.turns} turns ({args.calls}), {args.max_tokens} sampled tokens a turn"
    )
    header = f"{'prefix cache':<24}{'requested':>10}{'cached':>9}{'computed':>10}{'rollout s':>11}"
    print(header)
    print("-" * len(header))
    for row in rows:
        name = "off"
        if row["prefix_caching"]:
            name = "on, shared forwards" if row["shared_resumptions"] else "on, one at a time"
        print(
            f"{name:<24}{row['prompt_tokens_requested']:>10}"
            f"{row['prompt_tokens_cached']:>9}{row['prompt_tokens_computed']:>10}"
            f"{row['rollout_s']:>11.2f}"
        )
    fewer = off["prompt_tokens_computed"] / max(on["prompt_tokens_computed"], 1)
    faster = off["rollout_s"] / on["rollout_s"]
    sharing = alone["rollout_s"] / on["rollout_s"]
    print(
        f"prefill tokens computed {fewer:.2f}x fewer, rollout {faster:.2f}x shorter "
        f"({sharing:.2f}x from shared forwards)"
    )
    meta = {key: value for key, value in vars(args).items() if key != "out"}
    meta["model"] = Path(path).name
    results = {"rows": rows, "fewer_tokens": fewer, "speedup": faster, "sharing_speedup": sharing}
    write_results(args.out, meta, results)


if __name__ == "__main__":
    main()
