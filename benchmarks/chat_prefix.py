"""Time to first token through `areno serve`, prefix cache off and on, for two workloads.

- chats (default): each chat has an image in its first user turn and `--turns` user turns in
  all; every request carries the whole history as clients send it (the earlier answers as text,
  re-templated by the server). Each chat uses an image of its own, so nothing is cached from an
  earlier chat. The table gives each turn's median time to first token over `--chats` chats.
- shared-system: `--users` users, one at a time, each asking a question of its own after the
  same system prompt of about `--system-tokens` tokens (a deployment's instructions and tools).
  The table gives the median time to first token over the users after the first.
Requests are streamed through the official `openai` client over loopback HTTP. The server runs
twice, cache off then on (`EngineConfig.enable_prefix_caching`).

    python benchmarks/chat_prefix.py [--chats 8] [--turns 4]
    python benchmarks/chat_prefix.py --workload shared-system --family qwen3_5 [--users 64]
        [--prefill-compile inductor]
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
from engine_workloads import stop_on_terminate, write_results  # noqa: E402

from areno.engine.config import COMPILE_MODES, EngineConfig  # noqa: E402
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


def ttft(client, model: str, messages: list[dict], max_tokens: int) -> float:
    """One streamed request's time to its first token."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


def system_prompt(tokenizer, num_tokens: int) -> str:
    """About `num_tokens` tokens of numbered house rules (fixed text)."""
    rules, text = [], ""
    while len(tokenizer(text)["input_ids"]) < num_tokens:
        k = len(rules) + 1
        rules.append(f"Rule {k}: answer about topic {k * 7 % 101} briefly and cite section {k}.")
        text = "You are the assistant of a help desk. " + " ".join(rules)
    return text


def shared_system_ttfts(client, model: str, system: str, args) -> list[float]:
    """Each user's time to first token after the shared system prompt, the first user's
    included (the caller leaves it out)."""
    return [
        ttft(
            client,
            model,
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"User {user}: what does rule {user % 17 + 1} say?"},
            ],
            args.max_tokens,
        )
        for user in range(args.users)
    ]


def served(path: str, images: list[str], args, caching: bool) -> tuple[list[list[float]], dict]:
    import openai
    import ray
    from ray import serve

    from areno.serve.app import APP_NAME, build_app
    from areno.serve.config import ServeConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = EngineConfig(
        max_running_prompts=4, enable_prefix_caching=caching, prefill_compile=args.prefill_compile
    )
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
        if args.workload == "shared-system":
            from transformers import AutoTokenizer

            system = system_prompt(AutoTokenizer.from_pretrained(path), args.system_tokens)
            ttfts = [shared_system_ttfts(client, config.model_name, system, args)]
        else:
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
    stop_on_terminate()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["chats", "shared-system"], default="chats")
    parser.add_argument("--family", default="gemma4")
    parser.add_argument("--size", default="small", help="tiny checkpoint size (tiny, small)")
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--users", type=int, default=64, help="shared-system: users")
    parser.add_argument(
        "--system-tokens", type=int, default=1000, help="shared-system: its prompt's tokens"
    )
    parser.add_argument(
        "--prefill-compile",
        default="auto",
        choices=COMPILE_MODES,
        help="EngineConfig.prefill_compile (auto: off on CPU, inductor on CUDA)",
    )
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
    if args.workload == "shared-system":
        # The first user finds nothing cached either way: the median is over the others.
        medians = {
            caching: [statistics.median(chats[0][1:]) * 1e3] for caching, (chats, _) in runs.items()
        }
        print(
            f"\n{Path(path).name}: {args.users} users, a ~{args.system_tokens}-token system prompt"
        )
        print(f"{'':<8}{'TTFT off ms':>13}{'TTFT on ms':>13}{'ratio':>8}")
        off, on = medians[False][0], medians[True][0]
        print(f"{'users 2+':<8}{off:>13.1f}{on:>13.1f}{off / on:>8.2f}")
    else:
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
