"""A streamed reply's time between tokens, served against the same engine in process (CPU).

Workload (fixed seed): one tiny checkpoint (`--family`, default Qwen3.5), greedy, a short text
prompt, every reply exactly `--tokens` tokens long (`min_tokens` = `max_tokens`), one request at
a time.
- in-process: a `Generator` with the server's engine settings, streamed with `Generator.generate`
              in this process, with as many torch threads as the Generator replica has (Ray
              gives a replica its CPUs' worth of OpenMP threads, 1 by default).
- served:     the same request through `areno serve` (HTTP -> Ingress -> Generator replica),
              streamed with the official `openai` client; one app per `--stream-interval-ms`
              (the engine's `stream_interval_ms`: 0 sends every step's tokens in a message of
              their own, the baseline; the default holds them up to that long).
The ways take turns in each of `--rounds` rounds, so both run beside the same Ray processes and
a drifting machine load shifts them alike. A reply's time between tokens is (last token's
arrival - first token's arrival) / (tokens - 1): it counts tokens, not chunks, so a server that
sends several tokens in one chunk is measured by the tokens it delivers. Time to first token is
reported beside it. Prints a table and writes JSON (default
benchmarks/results/serve_stream.json).

    python benchmarks/serve_stream.py [--family qwen3_5] [--requests 20] [--rounds 4] [--tokens 64]
        [--stream-interval-ms 0 5]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from areno.engine.config import EngineConfig
from areno.engine.generator import Generator
from areno.engine.sampling import SamplingParams
from areno.models.tiny import tiny_checkpoint
from areno.processing import Processor


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question number {i}: tell me a long story."}]


class InProcess:
    """The engine in this process, streamed as the Generator replica streams it."""

    def __init__(self, path: str, engine: EngineConfig, tokens: int):
        import torch

        torch.set_num_threads(max(1, int(engine.num_cpus_per_rank)))  # the replica's CPUs
        self.processor = Processor(path)
        self.generator = Generator.from_config(path, engine)
        self.params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens)
        self.loop = asyncio.new_event_loop()

    def ask(self, i: int) -> tuple[float, float, int]:
        """(time to first token, time between tokens, tokens) of one streamed request."""
        start = time.perf_counter()
        inputs = self.processor.encode(question(i), [])

        async def stream() -> list[tuple[float, int]]:
            arrivals = []
            async for output in self.generator.generate(inputs, self.params):
                count = sum(len(sample.token_ids) for sample in output.samples)
                if count:
                    arrivals.append((time.perf_counter(), count))
            return arrivals

        return timings(start, self.loop.run_until_complete(stream()))

    def close(self) -> None:
        self.generator.shutdown()
        self.loop.close()


def timings(start: float, arrivals: list[tuple[float, int]]) -> tuple[float, float, int]:
    """(time to first token, mean time between tokens, tokens) from (arrival, tokens) pairs."""
    tokens = sum(count for _, count in arrivals)
    first, last = arrivals[0][0], arrivals[-1][0]
    # The first arrival's tokens beyond its first came with it: the gaps are tokens - 1.
    return first - start, (last - first) / max(tokens - 1, 1), tokens


class Served:
    """`areno serve` apps in one Ray on loopback, one per stream interval, each streamed with
    the openai client under its own route."""

    def __init__(self, path: str, engine: EngineConfig, intervals: list[float], tokens: int):
        import openai
        import ray
        from ray import serve

        from areno.serve.app import build_app
        from areno.serve.config import ServeConfig

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        self.clients = {}
        for interval in intervals:
            config = ServeConfig(
                model_path=path,
                port=port,
                engine=dataclasses.replace(engine, stream_interval_ms=interval),
            )
            route = f"/interval{interval:g}"
            serve.run(build_app(config), name=f"areno{interval:g}", route_prefix=route)
            url = f"http://127.0.0.1:{port}{route}/v1"
            self.clients[interval] = openai.OpenAI(base_url=url, api_key="none")
        self.model = config.model_name
        self.tokens = tokens
        self.chunks: dict[float, list[int]] = {interval: [] for interval in intervals}

    def ask(self, interval: float, i: int) -> tuple[float, float, int]:
        start = time.perf_counter()
        stream = self.clients[interval].chat.completions.create(
            model=self.model,
            messages=question(i),
            max_tokens=self.tokens,
            extra_body={"min_tokens": self.tokens},
            temperature=0,
            logprobs=True,  # one entry per token: counts the tokens of a chunk
            stream=True,
        )
        arrivals = []
        for chunk in stream:
            if not chunk.choices or chunk.choices[0].logprobs is None:
                continue
            count = len(chunk.choices[0].logprobs.content or [])
            if count:
                arrivals.append((time.perf_counter(), count))
        self.chunks[interval].append(len(arrivals))
        return timings(start, arrivals)

    def close(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_5")
    parser.add_argument("--requests", type=int, default=20, help="per way, over all rounds")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--stream-interval-ms",
        type=float,
        nargs="+",
        default=[0.0, EngineConfig().stream_interval_ms],
        help="one served app each (0: every step's tokens in a message of their own)",
    )
    parser.add_argument("--out", default="benchmarks/results/serve_stream.json")
    args = parser.parse_args()
    path = str(tiny_checkpoint(args.family))
    engine = EngineConfig(max_running_prompts=8)
    local = InProcess(path, engine, args.tokens)
    served = None
    ways: dict[str, Callable[[int], tuple[float, float, int]]] = {"in process": local.ask}
    try:
        served = Served(path, engine, args.stream_interval_ms, args.tokens)
        for interval in args.stream_interval_ms:
            ways[f"served, {interval:g} ms"] = functools.partial(served.ask, interval)
        for ask in ways.values():
            for i in range(3):
                ask(10_000 + i)  # warm-up
        results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in ways}
        per_round = max(args.requests // args.rounds, 1)
        for r in range(args.rounds):
            for w, (name, ask) in enumerate(ways.items()):
                # question numbers of its own: no request finds another's prompt cached
                base = (w * args.rounds + r) * per_round
                results[name] += [ask(base + i) for i in range(per_round)]
    finally:
        local.close()
        if served is not None:
            served.close()
    table = {}
    for name, rows in results.items():
        assert all(tokens == args.tokens for _, _, tokens in rows), "a reply was cut short"
        table[name] = {
            "ttft_p50_ms": statistics.median(r[0] for r in rows) * 1e3,
            "tbt_mean_ms": statistics.mean(r[1] for r in rows) * 1e3,
            "tbt_p50_ms": statistics.median(r[1] for r in rows) * 1e3,
        }
    floor = table["in process"]["tbt_mean_ms"]
    for interval in args.stream_interval_ms:
        row = table[f"served, {interval:g} ms"]
        row["over_in_process"] = row["tbt_mean_ms"] / floor
        # the warm-up's replies left out
        row["chunks_per_reply"] = statistics.mean(served.chunks[interval][3:])
    print(f"tiny {args.family}, {args.tokens} tokens a reply, {args.requests} replies a way")
    print(
        f"{'':18}{'TTFT p50 ms':>12}{'between tokens ms':>19}{'p50 reply':>11}"
        f"{'x in process':>14}{'chunks':>8}"
    )
    for name, row in table.items():
        ratio = f"{row['over_in_process']:.2f}" if "over_in_process" in row else "-"
        chunks = f"{row['chunks_per_reply']:.1f}" if "chunks_per_reply" in row else "-"
        print(
            f"{name:18}{row['ttft_p50_ms']:>12.1f}{row['tbt_mean_ms']:>19.2f}"
            f"{row['tbt_p50_ms']:>11.2f}{ratio:>14}{chunks:>8}"
        )
    report = {
        "meta": {
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
            "family": args.family,
            "tokens": args.tokens,
            "requests": args.requests,
            "rounds": args.rounds,
            "stream_interval_ms": args.stream_interval_ms,
        },
        "ways": table,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
