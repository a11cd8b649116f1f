"""Time to first token of a multi-turn chat through `areno serve`, prefix cache off and on.

Each chat has an image in its first user turn and `--turns` user turns in all; every request
carries the whole history as clients send it (the earlier answers as text, re-templated by the
server), streamed through the official `openai` client over loopback HTTP. Each chat uses an
image of its own, so nothing is cached from an earlier chat. The server runs twice, cache off
then on (`EngineConfig.enable_prefix_caching`), and the table gives each turn's median time to
first token over `--chats` chats.

    python benchmarks/chat_prefix.py [--chats 8] [--turns 4]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from engine_workloads import write_results  # noqa: E402

from areno.engine.config import EngineConfig  # noqa: E402
from areno.media.samples import write_image  # noqa: E402
from areno.models.tiny import tiny_checkpoint  # noqa: E402

QUESTIONS = [
    "Describe this picture in detail: the shapes, the colours and where they sit.",
    "Which of those shapes is the largest, and how sure are you?",
    "Now compare the left half of the picture with the right half.",
    "Summarize everything we said so far in two sentences.",
]


def chat_ttfts(client, model: str, image: str, args) -> list[float]:
    """Each turn's time to first token of one chat."""
    history: list[dict] = []
    ttfts = []
    for turn in range(args.turns):
        text = {"type": "text", "text": QUESTIONS[turn % len(QUESTIONS)]}
        content = [{"type": "image_url", "image_url": {"url": image}}, text] if not turn else [text]
        history.append({"role": "user", "content": content})
        start = time.perf_counter()
        first, answer = None, ""
        stream = client.chat.completions.create(
            model=model,
            messages=history,
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter() - start
                answer += chunk.choices[0].delta.content
        ttfts.append(first if first is not None else time.perf_counter() - start)
        history.append({"role": "assistant", "content": answer})
    return ttfts


def served(path: str, images: list[str], args, caching: bool) -> tuple[list[list[float]], dict]:
    import openai
    import ray
    from ray import serve

    from areno.serve.app import APP_NAME, build_app
    from areno.serve.config import ServeConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = EngineConfig(max_running_prompts=4, enable_prefix_caching=caching)
    config = ServeConfig(model_path=path, port=port, engine=engine)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        chat_ttfts(client, config.model_name, images[-1], args)  # warm-up, its own image
        generator = serve.get_deployment_handle("GeneratorServer", APP_NAME)
        before = generator.stats.remote().result()
        ttfts = [chat_ttfts(client, config.model_name, image, args) for image in images[:-1]]
        after = generator.stats.remote().result()
        counts = {
            key: after[key] - before[key]
            for key in ("num_prompt_tokens_admitted", "num_prompt_tokens_cached")
        }
        return ttfts, counts
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="gemma4")
    parser.add_argument("--size", default="small", help="tiny checkpoint size (tiny, small)")
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--out", default="benchmarks/results/chat_prefix.json")
    args = parser.parse_args()
    path = str(tiny_checkpoint(args.family, size=args.size))
    with tempfile.TemporaryDirectory() as tmp:
        size = args.image_size
        images = [
            str(write_image(Path(tmp) / f"{i}.png", size, size * 3 // 4, seed=i))
            for i in range(args.chats + 1)
        ]
        runs = {caching: served(path, images, args, caching) for caching in (False, True)}
    medians = {
        caching: [statistics.median(chat[t] for chat in chats) * 1e3 for t in range(args.turns)]
        for caching, (chats, _) in runs.items()
    }
    print(f"\n{Path(path).name}: {args.chats} chats x {args.turns} turns, an image in turn 1")
    print(f"{'turn':<6}{'TTFT off ms':>13}{'TTFT on ms':>13}{'ratio':>8}")
    for t in range(args.turns):
        off, on = medians[False][t], medians[True][t]
        print(f"{t + 1:<6}{off:>13.1f}{on:>13.1f}{off / on:>8.2f}")
    counts = runs[True][1]
    print(
        f"with the cache: {counts['num_prompt_tokens_cached']} of "
        f"{counts['num_prompt_tokens_admitted']} prompt tokens held"
    )
    meta = {key: value for key, value in vars(args).items() if key != "out"}
    results = {"ttft_ms_off": medians[False], "ttft_ms_on": medians[True], "tokens_on": counts}
    write_results(args.out, {**meta, "model": Path(path).name}, results)


if __name__ == "__main__":
    main()
