"""Prefix-aware routing against round robin: multi-turn chats through `areno serve` with
`--replicas` Generator replicas (`--world-size`, default 2; `--routing prefix` / `round_robin`).

`--chats` chats run at once, each `--turns` user turns one after the other, streamed through
the official `openai` client over loopback HTTP; every request carries the whole history (the
earlier answers as text, re-templated by the server) after a system prompt all chats share.
A chat's first turn holds a document of its own. The same workload (seeded) runs under each
policy in turn, `--rounds` times, each on a fresh app; the table gives per run the prompt
tokens the replicas admitted, those their prefix caches held (reused), and the median time to
first token of all requests and of the later turns. Counters come from each replica
(`GeneratorServer.replica_stats`).

    python benchmarks/route_prefix.py [--chats 32] [--turns 4] [--rounds 1] [--replicas 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from engine_workloads import stop_on_terminate, write_results  # noqa: E402

from areno.engine.config import EngineConfig  # noqa: E402
from areno.models.tiny import tiny_checkpoint  # noqa: E402

POLICIES = ("prefix", "round_robin")
APP = "route"
WORDS = [
    "river",
    "stone",
    "light",
    "paper",
    "window",
    "garden",
    "market",
    "signal",
    "engine",
    "orbit",
    "copper",
    "velvet",
    "harbor",
    "meadow",
    "lantern",
    "fabric",
    "canyon",
    "ledger",
    "summit",
    "timber",
    "quartz",
    "violet",
    "anchor",
    "ember",
    "falcon",
    "glacier",
    "island",
    "jungle",
    "kettle",
    "mirror",
    "needle",
    "oyster",
    "pepper",
    "quiver",
    "saddle",
    "tunnel",
    "willow",
]


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def workload(args) -> tuple[str, list[list[str]]]:
    """The shared system prompt and each chat's user turns (seeded)."""
    rng = random.Random(args.seed)
    system = "You are a careful analyst. " + _text(rng, args.system_words)
    chats = []
    for c in range(args.chats):
        document = f"Document {c}: " + _text(rng, args.document_words)
        turns = [f"{document}\nWhat is this document about?"]
        turns += [f"Question {t}: " + _text(rng, args.question_words) for t in range(1, args.turns)]
        chats.append(turns)
    return system, chats


async def run_chat(client, model: str, system: str, turns: list[str], args) -> list[float]:
    """Each turn's time to first token of one chat."""
    history = [{"role": "system", "content": system}]
    ttfts = []
    for text in turns:
        history.append({"role": "user", "content": text})
        start = time.perf_counter()
        first, answer = None, ""
        stream = await client.chat.completions.create(
            model=model, messages=history, max_tokens=args.max_tokens, temperature=0, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter() - start
                answer += chunk.choices[0].delta.content
        ttfts.append(first if first is not None else time.perf_counter() - start)
        history.append({"role": "assistant", "content": answer})
    return ttfts


def replica_counts() -> dict[str, tuple[int, int]]:
    from ray import serve

    handle = serve.get_deployment_handle("GeneratorServer", app_name=APP)
    replies = handle.broadcast("replica_stats").results(timeout_s=120)
    return {
        replica: (stats["num_prompt_tokens_admitted"], stats["num_prompt_tokens_cached"])
        for replica, stats in replies
    }


def one_run(path: str, port: int, policy: str, args) -> dict:
    """The workload on a fresh two-replica app routed by `policy`."""
    import openai
    from ray import serve

    from areno.serve.app import build_app
    from areno.serve.config import ServeConfig

    engine = EngineConfig(
        max_running_prompts=args.max_running_prompts,
        max_context_len=args.max_context_len,
        kv_cache_gib=args.kv_cache_gib,
    )
    config = ServeConfig(
        model_path=path,
        port=port,
        engine=engine,
        world_size=args.replicas,
        routing=policy,
        num_cpus_per_deployment=0.1,
    )
    serve.run(build_app(config), name=APP, route_prefix="/")
    system, chats = workload(args)

    async def session() -> tuple[dict, list[list[float]], float, dict]:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600
        )
        model = config.model_name
        # Every replica's first requests, outside the counts.
        warm = [[f"Warm-up {i}: " + " ".join(WORDS)] for i in range(2 * args.replicas)]
        await asyncio.gather(*(run_chat(client, model, "Hi.", turns, args) for turns in warm))
        before = await asyncio.to_thread(replica_counts)
        start = time.perf_counter()
        ttfts = await asyncio.gather(
            *(run_chat(client, model, system, turns, args) for turns in chats)
        )
        wall_s = time.perf_counter() - start
        await client.close()
        return before, ttfts, wall_s, await asyncio.to_thread(replica_counts)

    try:
        before, ttfts, wall_s, after = asyncio.run(session())
    finally:
        serve.delete(APP)
    grown = {r: [after[r][0] - before[r][0], after[r][1] - before[r][1]] for r in after}
    all_ttfts = [t for chat in ttfts for t in chat]
    later = [t for chat in ttfts for t in chat[1:]]
    return {
        "policy": policy,
        "prompt_tokens": sum(a for a, _ in grown.values()),
        "reused_tokens": sum(c for _, c in grown.values()),
        "per_replica": sorted(grown.values()),
        "ttft_ms_median": statistics.median(all_ttfts) * 1e3,
        "ttft_ms_median_later_turns": statistics.median(later) * 1e3,
        "ttft_ms_p90": statistics.quantiles(all_ttfts, n=10)[-1] * 1e3,
        "wall_s": wall_s,
        "ttft_ms_by_turn": [
            statistics.median(chat[t] for chat in ttfts) * 1e3 for t in range(args.turns)
        ],
    }


def main() -> None:
    stop_on_terminate()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_vl")
    parser.add_argument("--size", default="small", help="tiny checkpoint size (tiny, small)")
    parser.add_argument("--replicas", type=int, default=2, help="Generator replicas")
    parser.add_argument("--chats", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-words", type=int, default=32)
    parser.add_argument("--document-words", type=int, default=96)
    parser.add_argument("--question-words", type=int, default=12)
    parser.add_argument("--max-running-prompts", type=int, default=8)
    parser.add_argument("--max-context-len", type=int, default=2048)
    parser.add_argument(
        "--kv-cache-gib", type=float, help="each replica's KV pool (default: on CPU "
        "max-context-len tokens for each of max-running-prompts sequences)"
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="runs of each policy, in turns")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/route_prefix.json")
    args = parser.parse_args()
    random.seed(args.seed)
    path = str(tiny_checkpoint(args.family, size=args.size))

    import ray
    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Logical CPUs: a Generator replica takes one, the other deployments a tenth each.
    ray.init(num_cpus=2 + args.replicas, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        runs = [
            one_run(path, port, policy, args) for _ in range(args.rounds) for policy in POLICIES
        ]
    finally:
        serve.shutdown()
        ray.shutdown()

    print(
        f"\n{Path(path).name}: {args.replicas} replicas, {args.chats} chats x {args.turns} turns at once, "
        f"{args.max_tokens} tokens a reply"
    )
    head = ("policy", "prompt tok", "reused", "reused %", "TTFT p50 ms", "later p50", "wall s")
    print("".join(f"{h:>13}" for h in head))
    for run in runs:
        row = (
            run["policy"],
            run["prompt_tokens"],
            run["reused_tokens"],
            f"{100 * run['reused_tokens'] / max(run['prompt_tokens'], 1):.1f}",
            f"{run['ttft_ms_median']:.1f}",
            f"{run['ttft_ms_median_later_turns']:.1f}",
            f"{run['wall_s']:.1f}",
        )
        print("".join(f"{str(v):>13}" for v in row))
    for r in range(args.rounds):
        prefix, rr = runs[2 * r], runs[2 * r + 1]
        print(
            f"round {r + 1}: reused {prefix['reused_tokens'] / max(rr['reused_tokens'], 1):.2f}x "
            f"round robin's; median TTFT {prefix['ttft_ms_median']:.1f} against "
            f"{rr['ttft_ms_median']:.1f} ms"
        )
    meta = {key: value for key, value in vars(args).items() if key != "out"}
    write_results(args.out, {**meta, "model": Path(path).name}, {"runs": runs})


if __name__ == "__main__":
    main()
