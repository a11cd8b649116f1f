"""Latency the Serve hops add, and served requests/s for image and video requests (CPU).

Workload (fixed seed): the tiny Gemma 4 checkpoint; one-token greedy answers so generation is a
small, fixed part of each request.
- in-process: MediaDecoder + Processor + Generator called directly in this process (the floor),
              with as many torch threads as the Generator replica has (Ray sets a replica's
              OpenMP threads to its CPUs, 1 by default): one thread does this tiny model's step
              faster on 2 cores, and far faster when other work loads them.
- served:     the same request through `areno serve` (Ingress -> [MediaDecoder -> Processor ->]
              Generator) over loopback HTTP: text requests timed with one keep-alive httpx
              client as the echo app is (so the difference is the server's), and again with the
              official `openai` client, which adds its own request building and reply parsing.
- serve floor: beside it, through the same proxy, the echo app of `benchmarks/serve_floor.py` (the
              same HTTP -> Ingress -> one handle call topology, no work; httpx client): what
              Serve's hops cost before AReno does anything.
Text, image and video requests run one at a time (latency p50 / p99), in `--rounds` rounds in
which the in-process floor, the served requests and the echo app's take turns, so that all run
beside the same Ray processes and a machine whose load drifts shifts them alike; then image and
video requests run `--concurrency` at a time (requests/s). AReno's own share of a text request is
served p50 - echo p50 - in-process p50: what serving adds beyond Serve's own hops and the work
itself (the Ingress's parse, encode hand-off and reply, the handle call's payload, the replica's
bookkeeping). Prints a table and writes JSON (default benchmarks/results/serve_latency.json).

    python benchmarks/serve_latency.py [--requests 50] [--rounds 5] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from areno.engine.config import EngineConfig
from areno.engine.generator import Generator
from areno.engine.sampling import SamplingParams
from areno.media import MediaDecoder, MediaPolicy
from areno.media.samples import write_image, write_video
from areno.models.tiny import DEFAULT_FAMILY, tiny_checkpoint
from areno.processing import Processor, process_messages

sys.path.insert(0, str(Path(__file__).parent))
from engine_workloads import stop_on_terminate  # noqa: E402
from serve_floor import build_floor_app, time_echo  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def messages(kind: str, media: dict[str, str], i: int) -> list[dict]:
    text = {"type": "text", "text": f"Question number {i}: what is this?"}
    if kind == "text":
        return [{"role": "user", "content": text["text"]}]
    part = {"type": f"{kind}_url", f"{kind}_url": {"url": media[kind]}}
    return [{"role": "user", "content": [part, text]}]


class InProcess:
    """The in-process floor: MediaDecoder + Processor + Generator in this process, with as many
    torch threads as the Generator replica has."""

    def __init__(self, path: str, media: dict):
        import torch

        torch.set_num_threads(max(1, int(EngineConfig().num_cpus_per_rank)))  # the replica's CPUs
        self.media = media
        self.processor = Processor(path)
        self.decoder = MediaDecoder(MediaPolicy.for_training(), self.processor.decode_options())
        self.generator = Generator.from_config(path, EngineConfig(max_running_prompts=8))
        self.params = SamplingParams(temperature=0, max_tokens=1)
        self.loop = asyncio.new_event_loop()

    def ask(self, i: int) -> float:
        start = time.perf_counter()
        inputs = process_messages(self.processor, self.decoder, messages("text", self.media, i))
        self.loop.run_until_complete(self.generator.generate_all(inputs, self.params))
        return time.perf_counter() - start

    def close(self) -> None:
        self.generator.shutdown()
        self.loop.close()


def served(
    path: str, media: dict, num: int, concurrency: int, rounds: int, floor: InProcess
) -> dict:
    import openai
    import ray
    from ray import serve

    from areno.serve.app import APP_NAME, build_app
    from areno.serve.config import ServeConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServeConfig(model_path=path, port=port, engine=EngineConfig(max_running_prompts=8))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        # Serve's own floor beside it, through the same proxy: an echo app of the same topology.
        serve.run(build_floor_app(), name="floor", route_prefix="/floor")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")

        def ask(kind: str, i: int) -> float:
            start = time.perf_counter()
            client.chat.completions.create(
                model=config.model_name,
                messages=messages(kind, media, i),
                max_tokens=1,
                temperature=0,
            )
            return time.perf_counter() - start

        for i in range(3):
            ask("text", i), ask("image", i), ask("video", i)  # warm-up
        import httpx2

        http = httpx2.Client(timeout=30)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"

        def post(kind: str, i: int) -> float:
            body = {
                "model": config.model_name,
                "messages": messages(kind, media, i),
                "max_tokens": 1,
                "temperature": 0,
            }
            start = time.perf_counter()
            http.post(url, json=body).raise_for_status()
            return time.perf_counter() - start

        for i in range(3):
            floor.ask(10 * num + i)  # warm-up
        text, text_openai, echo, local = [], [], [], []
        one_at_a_time = {"image": [], "video": []}
        per_round = max(num // rounds, 1)
        for r in range(rounds):
            # question numbers of its own (none finds another's prompt cached)
            local += [floor.ask(2 * num + r * per_round + i) for i in range(per_round)]
            text += [post("text", r * per_round + i) for i in range(per_round)]
            for kind, times in one_at_a_time.items():
                times += [post(kind, 3 * num + r * per_round + i) for i in range(per_round)]
            # other question numbers than the httpx requests', so neither finds the other cached
            text_openai += [ask("text", num + r * per_round + i) for i in range(per_round)]
            echo_url = f"http://127.0.0.1:{port}/floor/v1/echo"
            echo += [ms / 1e3 for ms in time_echo(echo_url, per_round)]
        http.close()
        rates = {}
        for kind in ("image", "video"):
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(lambda i, k=kind: ask(k, i), range(num)))
            rates[kind] = num / (time.perf_counter() - start)
        return {
            "text": text,
            "text_openai": text_openai,
            "echo": echo,
            "in_process": local,
            "image": one_at_a_time["image"],
            "video": one_at_a_time["video"],
            "rates": rates,
        }
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    stop_on_terminate()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/serve_latency.json")
    args = parser.parse_args()
    path = str(tiny_checkpoint(DEFAULT_FAMILY))
    with tempfile.TemporaryDirectory() as tmp:
        media = {
            "image": str(write_image(Path(tmp) / "a.jpg", 320, 240)),
            "video": str(write_video(Path(tmp) / "v.mp4", seconds=2.0, fps=8.0)),
        }
        floor = InProcess(path, media)
        try:
            result = served(path, media, args.requests, args.concurrency, args.rounds, floor)
        finally:
            floor.close()
    floor = result["in_process"]
    rows = {
        "in_process_text_ms": {
            q: percentile(floor, v) * 1e3 for q, v in (("p50", 0.5), ("p99", 0.99))
        },
        "served_text_ms": {
            q: percentile(result["text"], v) * 1e3 for q, v in (("p50", 0.5), ("p99", 0.99))
        },
        "served_text_openai_client_ms": {
            q: percentile(result["text_openai"], v) * 1e3 for q, v in (("p50", 0.5), ("p99", 0.99))
        },
    }
    for kind in ("image", "video"):
        rows[f"served_{kind}_ms"] = {
            q: percentile(result[kind], v) * 1e3 for q, v in (("p50", 0.5), ("p99", 0.99))
        }
    added = {q: rows["served_text_ms"][q] - rows["in_process_text_ms"][q] for q in ("p50", "p99")}
    rows["serve_floor_echo_ms"] = {
        q: percentile(result["echo"], v) * 1e3 for q, v in (("p50", 0.5), ("p99", 0.99))
    }
    share = (
        rows["served_text_ms"]["p50"]
        - rows["serve_floor_echo_ms"]["p50"]
        - rows["in_process_text_ms"]["p50"]
    )
    print(f"{'':28}{'p50 ms':>10}{'p99 ms':>10}")
    for name, values in [*rows.items(), ("added_by_serve_ms", added)]:
        print(f"{name:28}{values['p50']:>10.1f}{values['p99']:>10.1f}")
    print(f"{'areno_share_p50_ms':28}{share:>10.1f}")
    for kind, rate in result["rates"].items():
        print(f"served {kind} requests/s at concurrency {args.concurrency}: {rate:.1f}")
    report = {
        "meta": {
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
            "requests": args.requests,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "model": "tiny gemma4",
            "median_text_latency_floor_ms": statistics.median(floor) * 1e3,
        },
        **rows,
        "added_by_serve_ms": added,
        "areno_share_p50_ms": share,
        "requests_per_s": result["rates"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
