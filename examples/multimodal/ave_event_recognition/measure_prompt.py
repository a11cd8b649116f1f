"""Encoded lengths of the AVE prompts, and of the tool results, on a checkpoint's own processor.

Media expand into many tokens (a video's frames and audio track, each tool frame, each audio
clip), so choose `--max-prompt-tokens` and `--max-context-len` from these numbers, not from the
text:

    python examples/multimodal/ave_event_recognition/measure_prompt.py --data data/ave \
        [--model-path /path/to/checkpoint] [--num-samples 8]

max_context_len >= prompt + turns x (max_tokens_per_turn + tool result), with the largest tool
result (view_frames) for every turn but the last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from areno.media.decoder import MediaDecoder
from areno.media.sources import MediaPolicy
from areno.processing.processor import Processor
from areno.rollout.agent import ToolContext
from examples.multimodal.ave_event_recognition.agent import ave_agent
from examples.multimodal.ave_event_recognition.loader import load


def measure(model_path: str, data: str, num_samples: int, max_frames: int) -> dict[str, int]:
    processor = Processor(model_path)
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    agent = ave_agent(max_frames=max_frames)
    lengths = {"prompt": 0, "view_frames": 0, "listen": 0}
    for sample in load(data, "train", num_samples):
        messages = agent.prompt_messages(sample.messages)
        media = decoder.decode_many(processor.media_refs(messages))
        prompt = processor.encode(messages, media, tools=agent.tool_schemas)
        lengths["prompt"] = max(lengths["prompt"], prompt.num_prompt_tokens)
        ctx = ToolContext(sample.id, sample.public().messages)
        duration = float(sample.private["duration_s"])
        for tool in ("view_frames", "listen"):
            result = agent.call_tool(tool, {"start_s": 0, "end_s": duration}, ctx)
            message = {"role": "tool", "tool_call_id": "call_0", "content": result}
            delta = processor.encode_continuation(
                [message],
                decoder.decode_many(processor.media_refs([message])),
                tools=agent.tool_schemas,
            )
            lengths[tool] = max(lengths[tool], delta.num_prompt_tokens)
    return lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the generated dataset directory")
    parser.add_argument("--model-path", help="checkpoint (default: the embedded tiny Gemma 4)")
    parser.add_argument("--num-samples", type=int, default=8)
    parser.add_argument("--max-frames", type=int, default=4, help="the agent's max_frames")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-tokens-per-turn", type=int, default=64)
    args = parser.parse_args()
    if args.model_path is None:
        from areno.models.tiny import tiny_checkpoint

        args.model_path = str(tiny_checkpoint("gemma4"))
    n = measure(args.model_path, args.data, args.num_samples, args.max_frames)
    context = (
        n["prompt"]
        + args.max_turns * args.max_tokens_per_turn
        + (args.max_turns - 1) * max(n["view_frames"], n["listen"])
    )
    print(f"longest encoded prompt: {n['prompt']} tokens")
    print(f"longest tool result: view_frames {n['view_frames']}, listen {n['listen']} tokens")
    print(f"suggested: --max-prompt-tokens {n['prompt']} --max-context-len {context}")


if __name__ == "__main__":
    main()
