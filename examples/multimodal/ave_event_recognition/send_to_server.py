"""Send a few AVE samples to a running `areno serve` with the official `openai` client.

The request is the training prompt: the same messages (clip + question), the agent's system
prompt and tool schemas. Clip paths are read by the server, so start it where they exist (or
generate with `--data-urls`):

    areno serve --model-path CKPT --max-running-prompts 1 --max-context-len 4096 --port 8000
    python examples/multimodal/ave_event_recognition/send_to_server.py --data data/ave
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from openai import OpenAI

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from examples.multimodal.ave_event_recognition.agent import ave_agent
from examples.multimodal.ave_event_recognition.loader import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the generated dataset directory")
    parser.add_argument("--split", default="validation")
    parser.add_argument("--num-samples", type=int, default=3)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    agent = ave_agent()
    for sample in load(args.data, args.split, args.num_samples):
        response = client.chat.completions.create(
            model=model,
            messages=agent.prompt_messages(sample.public().messages),
            tools=agent.tool_schemas,
            max_tokens=args.max_tokens,
        )
        message = response.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        print(f"{sample.id}: content={message.content!r} tool_calls={calls}")
        print(f"  prompt_tokens={response.usage.prompt_tokens} (media included)")


if __name__ == "__main__":
    main()
