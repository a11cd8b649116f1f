"""A streamed reply's time between tokens, served against the same engine in process.

Workload (fixed seed): one tiny checkpoint (`--family`, default Qwen3.5) or `--model-path`, greedy, a short text
prompt, every reply exactly `--tokens` tokens long (`min_tokens` = `max_tokens`), one request at
a time.
- in-process: a `Generator` with the server's engine settings, streamed with `Generator.generate`
              in this process, with as many torch threads as the Generator replica has (Ray
              gives a replica its CPUs' worth of OpenMP threads, 1 by default).
- served:     the same request through `areno serve` (HTTP -> Ingress -> Generator replica),
              streamed with the official `openai` client; one app per `--stream-interval-ms`
              (the engine's `stream_interval_ms`: 0 sends every step's tokens in a message of
              their own, the baseline; the default holds them up to that long).
One app runs at a time (a GPU app takes the GPU whole); the in-process engine and the app take
turns in each of `--rounds` rounds, so both run beside the same Ray processes and a drifting
machine load shifts them alike. A reply's time between tokens is (last token's
arrival - first token's arrival) / (tokens - 1): it counts tokens, not chunks, so a server that
sends several tokens in one chunk is measured by the tokens it delivers. Time to first token is
reported beside it. Prints a table and writes JSON (default
benchmarks/results/serve_stream.json).

    python benchmarks/serve_stream.py [--family qwen3_5] [--requests 20] [--rounds 4] [--tokens 64]
        [--stream-interval-ms 0 5]
    python benchmarks/serve_stream.py --model-path CKPT --kv-cache-gib 4     # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path

from engine_workloads import stop_on_terminate

from areno.engine.config import EngineConfig
from areno.engine.generator import Generator
from areno.engine.sampling import SamplingParams
from areno.models.tiny import tiny_checkpoint
from areno.processing import Processor

BEGUN = time.perf_counter()


def progress(what: str) -> None:
    """A line as each phase ends, flushed (a GPU run's starts take minutes: a run cut short
    still shows how far it got)."""
    print(f"[{time.perf_counter() - BEGUN:7.1f} s] {what}", flush=True)


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
    """`areno serve` in one Ray on loopback, one app at a time (a GPU app takes the GPU
    whole), streamed with the openai client."""

    def __init__(self, path: str, engine: EngineConfig, tokens: int):
        import ray
        from ray import serve

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        self.path, self.engine, self.tokens = path, engine, tokens
        self.chunks: list[int] = []

    def deploy(self, interval: float) -> None:
        """Serve the checkpoint with `stream_interval_ms` = `interval` (in place of the last)."""
        import openai
        from ray import serve

        from areno.serve.app import APP_NAME, build_app
        from areno.serve.config import ServeConfig

        engine = dataclasses.replace(self.engine, stream_interval_ms=interval)
        config = ServeConfig(model_path=self.path, port=self.port, engine=engine)
        serve.delete(APP_NAME)
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none")
        self.model = config.model_name
        self.chunks = []

    def ask(self, i: int) -> tuple[float, float, int]:
        start = time.perf_counter()
        stream = self.client.chat.completions.create(
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
        self.chunks.append(len(arrivals))
        return timings(start, arrivals)

    def close(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def main() -> None:
    stop_on_terminate()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_5", help="the tiny checkpoint's")
    parser.add_argument("--model-path", help="a checkpoint instead of the tiny one")
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        help="each engine's KV pool (on a GPU the in-process engine and every app share it)",
    )
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
    path = args.model_path or str(tiny_checkpoint(args.family))
    engine = EngineConfig(
        max_running_prompts=8, max_context_len=2048, kv_cache_gib=args.kv_cache_gib
    )
    local = InProcess(path, engine, args.tokens)
    progress("the engine in process is up")
    served = None
    results: dict[str, list[tuple[float, float, int]]] = {"in process": []}
    chunks = {}
    per_round = max(args.requests // args.rounds, 1)
    try:
        served = Served(path, engine, args.tokens)
        progress("Ray and Serve are up")
        for i in range(3):
            local.ask(10_000 + i)  # warm-up
        for w, interval in enumerate(args.stream_interval_ms):
            served.deploy(interval)
            progress(f"the app with stream_interval_ms {interval:g} is up")
            for i in range(3):
                served.ask(10_000 + i)  # warm-up
            served.chunks = []
            name = f"served, {interval:g} ms"
            results[name] = []
            for r in range(args.rounds):
                # question numbers of its own: no request finds another's prompt cached
                base = (w * args.rounds + r) * 2 * per_round
                results["in process"] += [local.ask(base + i) for i in range(per_round)]
                results[name] += [served.ask(base + per_round + i) for i in range(per_round)]
                progress(f"{name}: round {r + 1} of {args.rounds} done")
            chunks[interval] = statistics.mean(served.chunks)
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
        row["chunks_per_reply"] = chunks[interval]
    model = args.model_path or f"tiny {args.family}"
    print(f"{model}, {args.tokens} tokens a reply, {args.requests} replies a way")
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
            "model": args.model_path or f"tiny {args.family}",
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
